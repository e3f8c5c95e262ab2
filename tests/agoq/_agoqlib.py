"""Helpers shared by the AGoQ tests."""

import torch


def count_saved(fn):
    """(number of tensors autograd saves while ``fn`` runs, its result), counted by a plain hook."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return n[0], out
