#!/usr/bin/env bash
# Session 23's GPU calls:
#   OUT=dir bash benchmarks/gpu_s23.sh first   # the split path in row chunks, each chunk's update on a second
#                                            # stream beside the next chunk's GEMM, the GEMM told to leave SMs
#                                            # free (cuBLASLt's SM count target): tune_kernels.py --what forge_carve
#   OUT=dir bash benchmarks/gpu_s23.sh second  # the same timed as CUDA graph replays (GPU time), host time of a GEMM
# Work goes to /tmp/s23w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s23w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "forge carve"
      timeout 400 python3 benchmarks/tune_kernels.py --what forge_carve --out "$D" 2>&1 | grep -v Warn \
        | cut -c1-1500 | tail -16
      snap ;;
    second)  # the same as CUDA graph replays (GPU time: first/'s chunks paid ~0.14 ms of host time each), and
      # the host time of one dW GEMM call with cuBLAS and cuBLASLt
      gpuinfo
      log "forge carve, graphed"
      TUNE_CARVE_GRAPH=1 TUNE_CARVE_CHUNKS=2,3,4,8 TUNE_CARVE_SMS=8,16,24,32,48 timeout 500 python3 \
        benchmarks/tune_kernels.py --what forge_carve --out "$D" 2>&1 | grep -v Warn | cut -c1-1500 | tail -16
      snap ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap
