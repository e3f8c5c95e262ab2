# Session 3 exploration 5: AGoQ step after the alignment choice: profile, host cProfile, bench.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
timeout 100 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out $OUT/e 2>&1 | grep -v Warn | tail -1
timeout 120 python3 - > $OUT/e/cprofile_agoq_b8.txt 2>&1 <<'PY'
import cProfile, pstats, torch
import leantrain as lt
from leantrain.config import preset
from leantrain.model import Llama
torch.manual_seed(0)
cfg = preset("1b").model
with torch.device("cuda"):
    model = Llama(cfg).to(torch.bfloat16)
lt.agoq.apply(model, lt.agoq.Policy())
idx = torch.randint(0, cfg.vocab_size, (8, 1025), device="cuda")
def step():
    loss = model(idx[:, :-1], idx[:, 1:]); loss.backward()
    for p in model.parameters(): p.grad = None
for _ in range(3): step()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(3): step()
torch.cuda.synchronize()
pr.disable()
print(dict(model._agoq_packer.stats))
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(45)
PY
timeout 200 python3 benchmarks/bench_agoq.py --out $OUT/e 2>&1 | grep -v Warn | tail -2
