"""AGoQ's relative gradient error on the tiny preset in the four layouts (model.fused_proj x
model.fused_swiglu; the same weights, batches and seeds), the default policy.

    PYTHONPATH=src python3 benchmarks/results/2026-12-02_cpu_s20/agoq_layouts/agoq_layout_error.py
"""
import torch

from leantrain.agoq import Policy
from leantrain.agoq.calibrate import gradient_error
from leantrain.config import ModelConfig, preset
from leantrain.model import Llama

base = preset("tiny").model
print("tiny ffn_dim", base.ffn_dim, "dim", base.dim)
g = torch.Generator().manual_seed(0)
batches = [(x[:, :-1], x[:, 1:]) for (x,) in [(torch.randint(0, base.vocab_size, (8, 129), generator=g),) for _ in range(2)]]
torch.manual_seed(0)
ref = Llama(ModelConfig(**{**base.__dict__, "fused_proj": False, "fused_swiglu": False}))
sd = ref.state_dict()
for fp, sw in ((False, False), (True, False), (True, True), (False, True)):
    m = Llama(ModelConfig(**{**base.__dict__, "fused_proj": fp, "fused_swiglu": sw}))
    m.load_state_dict(sd)
    errs = []
    for seed in range(3):
        e = gradient_error(m, batches, Policy(), seed=seed)
        errs.append(e["total"])
    rtn = gradient_error(m, batches, Policy(stochastic=False))
    down = max(v for k, v in rtn["per_param"].items() if "down_proj" in k)
    print(f"fused_proj={fp} fused_swiglu={sw}: total error (SR, 3 seeds) {[round(x, 4) for x in errs]}, round-to-nearest {rtn['total']:.4f}, worst down_proj {down:.4f}")
