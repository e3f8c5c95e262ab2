"""Per-role gradient error on a trained tiny model (a baseline checkpoint).
usage: graderr.py CKPT_DIR [K] [extra-policies-json]
For each role alone (others kept) at 4 and 8 bits: mean relative error over K seeds, and the
relative error of the K-seed mean gradient (bias estimate: pure noise falls as 1/sqrt(K))."""
import json
import math
import sys
import time

from leantrain import data as data_mod
from leantrain.agoq import ROLES, Policy
from leantrain.agoq.calibrate import param_grads
from leantrain.agoq.policy import KEEP
from leantrain.runtime.checkpoint import load as ck_load
from leantrain.config import preset
from leantrain.model import Llama

ck = sys.argv[1]
K = int(sys.argv[2]) if len(sys.argv) > 2 else 4
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
cfg = preset("tiny")
d = data_mod.load(cfg.data, log=lambda *a: None)
cfg.model.vocab_size = d.vocab_size
m = Llama(cfg.model)
ms, _, _ = ck_load(ck)
m.load_state_dict(ms)
batches = [d.batch("train", 128, 16, seed=7, step=5000 + i) for i in range(1)]
ref = param_grads(m, batches, None)
ref2 = param_grads(m, [d.batch("train", 128, 16, seed=7, step=6000)], None)

def rel(a, b):
    num = sum((a[n] - b[n]).norm().item() ** 2 for n in b)
    den = sum(b[n].norm().item() ** 2 for n in b)
    return math.sqrt(num / den)

print(json.dumps({"batch_to_batch": round(rel(ref2, ref), 4)}), flush=True)

def measure(name, pol):
    t0 = time.time()
    gs = [param_grads(m, batches, pol, seed=s) for s in range(K)]
    errs = [rel(g, ref) for g in gs]
    mean = {n: sum(g[n] for g in gs) / K for n in ref}
    out = {"name": name, "err": round(sum(errs) / K, 4), "err_of_mean": round(rel(mean, ref), 4),
           "noise_only_expect": round(sum(errs) / K / math.sqrt(K), 4), "s": round(time.time() - t0, 1)}
    print(json.dumps(out), flush=True)

keep = Policy(**{r: KEEP for r in ROLES})
if extra is None:
    measure("default", Policy())
    for r in ["qkv_in", "attn", "o_in", "mlp_in", "gate_up", "down_in", "norm", "head_in", "logits"]:
        for b in (4, 8):
            measure(f"{r}@{b}", keep.replace(**{r: b}))
else:
    for name, kw in extra.items():
        base = keep if kw.pop("_alone", False) else Policy()
        measure(name, base.replace(**kw))
