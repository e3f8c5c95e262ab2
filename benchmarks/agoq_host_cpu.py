"""Host time AGoQ adds to a forward, on the CPU, with the kernels stubbed out.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/agoq_host_cpu.py

The 1b preset's layer structure (22 layers, the same modules and saved tensors: ~940 saves a
forward, 334 of them packed) at tiny widths (dim 64, 8 tokens), so every op is a few µs and
what is measured is Python and dispatch: the host work that makes AGoQ's forward host-bound on
the GPU machine. ``quantize_many`` is replaced by a stub that only builds the QTensors. Each
number is the minimum over 60 forwards (robust to a noisy machine). Prints one line per setup:
plain; identity saved-tensor hooks; the role module hooks alone; the full packer (batched);
persistent ``apply`` without and with replay (the recorded plan followed, role hooks removed).
Caveat: the packer frees the tensors it held at its flush inside the timed forward, where
with identity hooks autograd frees them later, outside it.

``--real-multi``: the real ``quantize_many`` host path (table, allocations, QTensors) with only
its kernel launch stubbed (``TRITON_INTERPRET=1``, the batch backend forced to "triton"),
instead of the stub that only builds the QTensors.

``--minimal-hook``: also a lower bound for trimming the pack hook: a hook that only classifies,
deduplicates and registers the tensor in the batch (no statistics, ledger or byte counts),
timed in alternating rounds with the full packer (minimum of each over the rounds).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-multi", action="store_true", help="the real quantize_many host path, launch stubbed")
    ap.add_argument("--minimal-hook", action="store_true", help="also time a stripped-down pack hook (lower bound)")
    ap.add_argument("--derive", default=None, help="agoq.Policy.derive (default: the policy's)")
    ap.add_argument("--bf16", action="store_true", help="the model in bf16 (as on the GPU: 4-bit rows on the word path)")
    ap.add_argument("--flushes", type=int, default=0,
                    help="batch_mib set for about this many flushes a forward (the 1b step on the GPU: ~17 at 512 MiB; "
                         "0: the policy's batch_mib, one flush a forward at these widths)")
    a = ap.parse_args(argv)
    if a.real_multi:
        os.environ["TRITON_INTERPRET"] = "1"
    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama
    from leantrain.ops import QTensor

    P = importlib.import_module("leantrain.agoq.pack")  # the package attribute is the function
    H = importlib.import_module("leantrain.agoq.hooks")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = preset("1b").model
    cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size = 64, 4, 2, 128, 256
    model = Llama(cfg)
    if a.bf16:
        model = model.to(torch.bfloat16)

    def stub(xs, bits=8, group_size=128, symmetric=True, **_):
        widths = bits if isinstance(bits, list) else [bits] * len(xs)
        return [QTensor(torch.empty(0, dtype=torch.uint8), torch.empty(0), None, x.shape, x.dtype, b, group_size,
                        symmetric) for x, b in zip(xs, widths)]

    if a.real_multi:
        M = importlib.import_module("leantrain.ops.multi")
        M.launch = lambda *args, **meta: None
        H.Packer.batch_backend = "triton"
    else:
        P.quantize_many = stub
    H.Packer.batch_devices = ("cpu",)
    idx = torch.randint(0, 256, (1, 9))

    def forward_ms(ctx=None, n=60) -> float:
        ts = []
        for i in range(n + 5):
            t = time.perf_counter()
            if ctx is None:
                loss = model(idx[:, :-1], idx[:, 1:])
            else:
                with ctx():
                    loss = model(idx[:, :-1], idx[:, 1:])
            dt = time.perf_counter() - t
            del loss
            if i >= 5:
                ts.append(dt)
        return min(ts) * 1e3

    def identity():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    print(f"plain                        {forward_ms():6.2f} ms")
    print(f"identity saved-tensor hooks  {forward_ms(identity):6.2f} ms")
    kw = {} if a.derive is None else {"derive": a.derive}
    if a.flushes:  # the bytes one forward registers in batches (fp32 at these widths), over the flushes
        probe = H.Packer(model, lt.agoq.Policy(min_numel=0, **kw))
        probe.install()
        with probe:
            model(idx[:, :-1], idx[:, 1:])
        probe.remove()
        raw = sum(probe.numel.values()) * (2 if a.bf16 else 4)
        kw["batch_mib"] = raw / a.flushes / 2**20
    pol = lt.agoq.Policy(min_numel=0, **kw)
    pk = H.Packer(model, pol)
    pk.install()
    print(f"role module hooks only       {forward_ms():6.2f} ms")
    print(f"full packer                  {forward_ms(lambda: pk):6.2f} ms")
    print(f"saves per forward: {pk.stats['saved'] // 65}, packed {pk.stats['packed'] // 65}, batch_mib {pol.batch_mib:.4g}")
    pk.remove()
    for replay in (False, True):
        ap = lt.agoq.apply(model, pol, replay=replay)
        ms = forward_ms()
        per = {k: v // 65 for k, v in ap.stats.items() if k in ("saved", "packed", "replay:diverged")}
        print(f"{'apply, replay' if replay else 'apply, no replay':29s}{ms:6.2f} ms  {per}")
        lt.agoq.remove(model)
    pk.install()
    if a.minimal_hook:
        full = H.Packer.pack_hook
        best = {"full packer": float("inf"), "minimal pack hook": float("inf")}
        for _ in range(5):
            for name, hook in (("full packer", full), ("minimal pack hook", _minimal_hook(H, P))):
                H.Packer.pack_hook = hook
                best[name] = min(best[name], forward_ms(lambda: pk, n=30))
        H.Packer.pack_hook = full
        for name, ms in best.items():
            print(f"{name + ' (alternating)':29s}{ms:6.2f} ms")
    return 0


def _minimal_hook(H, P):
    """A pack hook that keeps only what packing needs (for a lower bound, not for use): the
    parameter fast path, the keep / pack decision, dedup and batch registration."""
    import weakref

    from torch import nn

    def hook(self, t, explicit=False):
        base = t._base
        if type(t if base is None else base) is nn.Parameter:
            return t
        role = self._roles[-1] if self._roles else "other"
        sp = t.data_ptr() - t.storage_offset() * t.element_size()
        if (sp in self._static or t.dtype == torch.bool or not t.is_floating_point() or not t.requires_grad
                or t.shape[-1] == 1 or (role == "attn" and t.dtype == torch.float32 and t.dim() <= 3)):
            return t
        bits = self._bits.get(role)
        if bits is None:
            bits = self._bits[role] = self.policy.bits_for(role, self.stage)
        if bits not in (4, 8):
            return t
        key = (sp, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        hit = self._dedup.get(key)
        if hit is not None and hit[0]() is not None:
            hit[1].uses += 1
            return hit[1]
        self._n += 1
        batch = self._batches.get(True)
        if batch is None:
            batch = self._batches[True] = P.PackBatch(self.policy.group_size, True, True, self.batch_backend)
        src = t if t.is_contiguous() else t.detach().contiguous()
        p = P.Packed("q", None, t.shape, t.dtype, t.device, bits, 0, batch=batch)
        batch.add(src, p, self._n)
        self._dedup[key] = (weakref.ref(t if base is None else base), p)
        return p

    return hook


if __name__ == "__main__":
    sys.exit(main())
