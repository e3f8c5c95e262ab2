"""Usage: PYTHONPATH=src OMP_NUM_THREADS=1 python sim_clip.py OUT_DIR {ratio|step1exact|mixed|exact}

Simulate FORGE clipping estimators in the unfused reference optimizer (lt.optim.Optimizer):
every gradient is materialized, then each fused layer's gradient is scaled as FORGE would scale
it in backward order, the non-fused ones by the exact global norm. "ratio" is est_global with
beta = 0 (the previous step's per-layer sums as prediction); "step1exact" the same with step 1
clipped by the exact global norm; "exact" = global-norm clipping. Train under the trainer's
clipping hook (torch.nn.utils.clip_grad_norm_ is replaced), tiny preset, 300 steps."""
import math
import sys

import torch

from leantrain import config as config_mod
from leantrain.train.trainer import Trainer

out, mode = sys.argv[1], sys.argv[2]
alpha = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
# FORGE's backward order on the Llama model (recorded from ForgeOptimizer._pending_sumsq)
order = ["lm_head"] + [f"layers.{i}.{m}" for i in reversed(range(4)) for m in
                       ("mlp.down_proj", "mlp.up_proj", "mlp.gate_proj", "self_attn.o_proj",
                        "self_attn.v_proj", "self_attn.k_proj", "self_attn.q_proj")]
holder = {"prev": None, "P": None, "t": 0}
def clip(params, c, *a, **k):
    params = list(params)
    m = holder["tr"].model
    mods = dict(m.named_modules())
    layers = [[mods[L].weight] for L in order]
    fused = {id(p) for g in layers for p in g}
    rest = [p for p in params if p.grad is not None and id(p) not in fused]
    cur = [float(sum(p.grad.double().square().sum() for p in g)) for g in layers]
    total = sum(cur) + float(sum(p.grad.double().square().sum() for p in rest))
    holder["t"] += 1
    exact = min(1.0, c / (math.sqrt(total) + 1e-6))
    prev, P = holder["prev"], holder["P"]
    S = C = Q = 0.0
    for i, g in enumerate(layers):
        S += cur[i]
        if prev is not None:
            C += cur[i]
            Q += prev[i]
        if prev is None:
            est = S
        elif mode == "mixed":
            est = P - Q + S
        else:  # ratio with exponent alpha on C/Q applied to the unprocessed remainder
            est = max(S, S + (P - Q) * (C / Q) ** alpha) if Q > 0 else S
        sc = min(1.0, c / (math.sqrt(est) + 1e-6))
        if mode == "exact" or (mode == "step1exact" and prev is None):
            sc = exact
        for p in g:
            p.grad.mul_(sc)
    for p in rest:
        p.grad.mul_(exact)
    holder["prev"], holder["P"] = cur, total
    return torch.tensor(math.sqrt(total))
torch.nn.utils.clip_grad_norm_ = clip
cfg = config_mod.build("tiny", None, {"train.steps": 300, "train.sample_tokens": 0, "train.eval_every": 50,
                                     "train.progress": False, "train.ckpt_every": 0})
tr = Trainer(cfg, out)
holder["tr"] = tr
tr.fit()
