#!/usr/bin/env bash
# One 125m AGoQ run, 1000 steps, with a stochastic-rounding seed; keeps its metrics.jsonl and summary.json:
#   bash benchmarks/run_125m_agoq.sh SEED DEST_DIR        (PYTHONPATH=src, on a GPU)
set -u -o pipefail
seed=$1; dest=$2
timeout 160 python3 -m leantrain train --preset 125m --steps 1000 --agoq --agoq.seed "$seed" --out "/tmp/c125_agoq_s$seed" \
  --data.max-corpus-mb 16 --train.eval-every 200 --train.ckpt-every 0 --train.sample-tokens 0 \
  --train.log-every 50 2>&1 | grep -v "^step" | tail -2
mkdir -p "$dest"; cp "/tmp/c125_agoq_s$seed/metrics.jsonl" "/tmp/c125_agoq_s$seed/summary.json" "$dest/" 2>/dev/null
