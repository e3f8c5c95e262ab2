"""The model: Llama (``llama.py``) and its fused LM-head loss (``losses.py``)."""

from leantrain.model.llama import (
    Llama,
    LMHead,
    RMSNorm,
    apply_rope,
    chunked_cross_entropy,
    rope_tables,
)

__all__ = ["LMHead", "Llama", "RMSNorm", "apply_rope", "chunked_cross_entropy", "rope_tables"]
