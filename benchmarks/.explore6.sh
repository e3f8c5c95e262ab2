# Session 3 exploration 2: host time per call of AGoQ's save path; cProfile of one AGoQ step.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/h
timeout 120 python3 benchmarks/host_overhead.py --out $OUT/h/host_overhead.json 2>&1 | grep -v Warn
timeout 200 python3 - > $OUT/h/cprofile_agoq_b8.txt 2>&1 <<'PY'
import cProfile, pstats, torch, time
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
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(40); st.sort_stats("cumulative").print_stats(40)
PY
tail -5 $OUT/h/cprofile_agoq_b8.txt
