#!/usr/bin/env bash
# Session 15's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s15.sh first   # FORGE kernel tests compiled (PREFETCH); profile_step --graph at B = 1, 4:
#                                            # torch bf16 and FORGE bf16 states + bf16 dW (GPU time by kernel under the
#                                            # graph); tune_kernels --what forge_prefetch (the fused kernel reading W and
#                                            # state before its token loop, against split paths and torch)
# Work goes to /tmp/s15w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s15w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s15w "$PART"; }
prof() {  # $1 config, $2 batch, rest: more profile_step arguments
  log "profile_step $1 B=$2 ${*:3}"
  timeout 120 python3 benchmarks/profile_step.py --config "$1" --batch "$2" "${@:3}" --out "$D/prof" 2>&1 | grep -v Warn | tail -2
}
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: FORGE kernel (compiled)"
      gputest 180 tests/forge/test_forge_kernel.py
      snap
      for b in 1 4; do
        prof torch_bf16 $b --graph
        prof forge_bf16_states_bf16_dw $b --graph
        snap
      done
      log "tune forge_prefetch"
      timeout 280 python3 benchmarks/tune_kernels.py --what forge_prefetch --out "$D" 2>&1 | grep -v Warn | tail -30
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap
