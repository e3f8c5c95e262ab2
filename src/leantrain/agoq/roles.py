"""The role of a module: what the activations saved while it runs are (``qkv_in``, ``norm``,
``attn``, ...), read from its name and class. :class:`leantrain.agoq.packer.Packer` pushes and
pops it with forward hooks; :class:`leantrain.agoq.policy.Policy` gives each role its bits."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["role_of_module"]

_QKV = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "query", "key", "value")
_OUT = ("o_proj", "out_proj", "dense", "c_proj")
_MLP_IN = ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc")
_DOWN = ("down_proj", "w2", "fc2")
_HEAD = ("lm_head", "output", "head")


def _linear_like(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not isinstance(m, nn.Embedding)


def role_of_module(name: str, m: nn.Module) -> str | None:
    """The role of tensors saved while ``m`` (named ``name``) runs, or None to inherit."""
    leaf = name.rsplit(".", 1)[-1]
    cls = type(m).__name__
    if _linear_like(m):
        if leaf in _QKV:
            return "qkv_in"
        if leaf in _OUT:
            return "o_in"
        if leaf in _MLP_IN:
            return "mlp_in"
        if leaf in _DOWN:
            return "down_in"
        if leaf in _HEAD:
            return "head_in"
        return "linear_in"
    if cls.endswith(("RMSNorm", "LayerNorm", "Norm")) or isinstance(m, nn.LayerNorm):
        return "norm"
    if "Attention" in cls:
        return "attn"
    if "MLP" in cls or "FeedForward" in cls:
        return "gate_up"
    return None
