#!/bin/bash
# usage (from the repository root): run.sh NAME [train args...]  -> $OUT/NAME (default OUT=/tmp/agoqconv)
# e.g. run.sh baseline --baseline ; run.sh agoq-attn8-prob4 --agoq
name=$1; shift
OUT=${OUT:-/tmp/agoqconv}
PY=${PY:-python3}
unset TRITON_INTERPRET
export OMP_NUM_THREADS=1
rm -rf "$OUT/$name"
/usr/bin/time -f "wall %e s" env PYTHONPATH=src "$PY" -m leantrain.cli train --preset tiny --steps 300 \
  --train.eval-every 50 --train.sample-tokens 0 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
