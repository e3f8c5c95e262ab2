#!/usr/bin/env bash
# Every GPU test and benchmark of leantrain in one call (the device tool runs this on an H200):
#   bash benchmarks/gpu_all.sh [quick]
# Writes everything under $OUT (default ./gpu_out): results.tgz (all result files) and run.log.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_out}
MODE=${1:-full}
RES=/tmp/leantrain_results
rm -rf "$RES"; mkdir -p "$RES" "$OUT"
export LEANTRAIN_TEST_GPU=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/leantrain_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
Q=""; [ "$MODE" = quick ] && Q="--quick"
log() { echo "=== $(date +%T) $*"; }
{
  log "environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

  log "GPU tests"
  timeout 420 python3 -m pytest tests -q -m gpu -x -p no:cacheprovider -o addopts="" 2>&1 | tail -40 | tee "$RES/gpu_tests.txt"

  for b in ops forge agoq comm; do
    [ -f benchmarks/bench_$b.py ] || continue
    log "bench $b"
    timeout 600 python3 benchmarks/bench_$b.py --out "$RES/$b" $Q 2>&1 | tail -80
  done

  log "1b preset, bf16, a few training steps through the trainer"
  for recipe in "--baseline" "" "--forge"; do
    name=train_1b${recipe:-_reference}
    timeout 400 python3 -m leantrain train --preset 1b --steps 6 --out /tmp/$name $recipe \
      --data.max-corpus-mb 8 --train.eval-every 0 --train.ckpt-every 0 --train.sample-tokens 0 \
      --train.log-every 1 --optim.warmup-steps 2 2>&1 | tail -12
    cp /tmp/$name/summary.json "$RES/$name.json" 2>/dev/null
  done
  log "done"
} 2>&1 | tee "$OUT/run.log"
tar czf "$OUT/results.tgz" -C "$RES" .
