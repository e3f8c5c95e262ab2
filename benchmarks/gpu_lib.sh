# Shared steps of the benchmarks/gpu_s*.sh device scripts (sourced; needs D, the output folder,
# which gpu_part sets).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
log() { echo "=== $(date +%T) $*"; }
gpuinfo() { log env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; }
gputest() { LEANTRAIN_TEST_GPU=1 timeout "$1" python3 -m pytest -q -p no:cacheprovider -o addopts="" "${@:2}" 2>&1 | tail -15; }
profiles() {  # profile_step of torch bf16 and AGoQ, B = 8, forward + backward ("$@": e.g. --cprofile)
  for c in torch_bf16 agoq; do
    log "profile $c B=8 forward+backward"
    timeout 90 python3 benchmarks/profile_step.py --config $c --batch 8 --no-opt "$@" --out "$D" 2>&1 | grep -v Warn | tail -1
  done
}
agoqbench() {  # bench_agoq: 1b, B = 8 ($1: time limit)
  log "bench agoq (1b, B=8)"
  timeout "$1" python3 benchmarks/bench_agoq.py --out "$D" 2>&1 | tail -2
}
opsbench() {  # bench_ops at 256 MiB and 2 GiB ($1: time limit)
  log "bench ops 256, 2048 MiB"
  timeout "$1" python3 benchmarks/bench_ops.py --sizes 256,2048 --rep 60 --out "$D/ops.json" 2>&1 | tail -3
}
agoqrun() {  # $1 name, $2 time limit, rest: env assignments; AGOQ_ARGS: more bench_agoq arguments
  local name=$1 lim=$2
  shift 2
  log "bench agoq (1b, B=8, 16 steps) $name: $* ${AGOQ_ARGS:-}"
  mkdir -p "$D/agoq_$name"
  env "$@" timeout "$lim" python3 benchmarks/bench_agoq.py --steps 16 ${AGOQ_ARGS:-} --out "$D/agoq_$name" 2>&1 | tail -1
  if [ -n "${FLAT:-}" ]; then  # one file per run (the device tool returns at most 8)
    mv "$D"/agoq_"$name"/*.json "$D/agoq_$name.json" && rm -r "$D/agoq_$name"
  fi
}
train1b() {  # $1 name, rest: trainer arguments (1b, B = 8, 16 steps, every step logged)
  local name=$1
  shift
  local common="--preset 1b --steps 16 --data.batch-size 8 --data.max-corpus-mb 6 --train.eval-every 0 --train.ckpt-every 0"
  common="$common --optim.warmup-steps 2 --train.sample-tokens 0 --train.progress false --train.log-every 1"
  log "train 1b $name: $common $*"
  timeout 80 python3 -m leantrain train $common "$@" --out "$D/$name" 2>&1 | grep -v Warn | tail -3
  cp "$D/$name/summary.json" "$D/train1b_$name.json" 2>/dev/null
  cp "$D/$name/metrics.jsonl" "$D/train1b_${name}_metrics.jsonl" 2>/dev/null
  rm -rf "$D/$name"
}
train1b_trio() {  # the 1b trainer: baseline, FORGE + AGoQ, FORGE int8 + AGoQ
  train1b baseline --baseline
  train1b forge_agoq --forge --agoq
  train1b forge_int8_agoq --forge --forge.state-dtype int8 --agoq
}
forgeb() {  # bench_forge part (b): 1b, T = 1024, B = 1, 4, 16, each configuration in a fresh process ($1: time limit)
  log "forge part (b): 1b, T = 1024, B = 1, 4, 16"
  timeout "$1" python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 45 --out "$D/b" 2>&1 \
    | grep -v Warn | tail -24
  for f in "$D/b"/*; do [ -e "$f" ] && mv "$f" "$D/forge_b.${f##*.}"; done
  rmdir "$D/b" 2>/dev/null
}
forgeb_cfg() {  # bench_forge part (b): $1 name, $2 time limit, $3 batches (quoted list), rest: configurations
  local name=$1 lim=$2 batches=$3
  shift 3
  log "forge part (b) $name: B = $batches: $* ${LEANTRAIN_FORGE_TILE:-} ${LEANTRAIN_FORGE_EARLY_LOADS:-}"
  timeout "$lim" python3 benchmarks/bench_forge.py --part b --batches $batches --timeout 70 --configs "$@" \
    --out "$D/$name" 2>&1 | grep -v Warn | tail -12
}
prof() {  # profile_step: $1 config, $2 batch, rest: more profile_step arguments (into $D/prof)
  log "profile_step $1 B=$2 ${*:3}"
  timeout 120 python3 benchmarks/profile_step.py --config "$1" --batch "$2" "${@:3}" --out "$D/prof" 2>&1 | grep -v Warn | tail -2
}
forgeb_ws() {  # the graphed 1b step (B = 1, 2) with every linear through the split path, then through the ws
  # kernel (LEANTRAIN_FORGE_WS_TOKENS=4096), into $D/b_ws0 and $D/b_ws4096; snap after each
  LEANTRAIN_FORGE_WS_TOKENS=0 forgeb_cfg b_ws0 110 "1 2" torch_bf16_graph forge_bf16_sr_bf16_states_graph \
    forge_bf16_sr_fp32_states_graph
  snap
  LEANTRAIN_FORGE_WS_TOKENS=4096 forgeb_cfg b_ws4096 90 "1 2" forge_bf16_sr_bf16_states_graph \
    forge_bf16_sr_fp32_states_graph
  snap
}
tunews() {  # benchmarks/tune_ws.py: $1 time limit, $2 name ($D/NAME.jsonl, .err), rest: its arguments; prints the rows
  local lim=$1 name=$2
  shift 2
  timeout "$lim" python3 benchmarks/tune_ws.py "$@" > "$D/$name.jsonl" 2> "$D/$name.err"
  echo "rc=$?"; cat "$D/$name.jsonl"; tail -3 "$D/$name.err"
}
gpu_part() {  # $1 the session's scratch root (/tmp/sNw), $2 the part: sets PART and D (made), and snap,
  # which rewrites $OUT/PART.tgz from D (call it after each stage: what a time-out leaves comes back)
  SCRATCH=$1 PART=$2 D=$1/$2
  mkdir -p "$D"
  snap() { tar czf "$OUT/$PART.tgz" -C "$SCRATCH" "$PART"; }
}
