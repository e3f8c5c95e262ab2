# Session 3 exploration 1: where AGoQ's step time goes (1b, B = 8, forward + backward).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/p
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/p/gpu.txt 2>&1
for c in torch_bf16 agoq; do
  timeout 120 python3 benchmarks/profile_step.py --config $c --batch 8 --no-opt --out $OUT/p 2>&1 | grep -v Warn | tail -2
done
