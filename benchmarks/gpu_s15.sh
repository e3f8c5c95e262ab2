#!/usr/bin/env bash
# Session 15's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s15.sh first   # FORGE kernel tests compiled (PREFETCH); profile_step --graph at B = 1, 4:
#                                            # torch bf16 and FORGE bf16 states + bf16 dW (GPU time by kernel under the
#                                            # graph); tune_kernels --what forge_prefetch (the fused kernel reading W and
#                                            # state before its token loop, against split paths and torch)
#   OUT=dir bash benchmarks/gpu_s15.sh second  # update kernel: 32-bit offsets + one hash round, hardware bf16 rounding:
#                                            # FORGE kernel / rest / device-scalar / graph tests compiled; tune_kernels
#                                            # --what forge_update16 (bf16 update tiles on the 1b shapes vs torch's fused
#                                            # AdamW); bench_forge part (b) graphed at B = 1, 4 with the default tile and
#                                            # the sweep's best (LEANTRAIN_FORGE_TILE); profile_step --graph at B = 1
#   OUT=dir bash benchmarks/gpu_s15.sh third   # update tiles with fewer registers a thread (forge_update16 again); part (b)
#                                            # graphed at B = 1, 4, 16: torch bf16 and FORGE with the sweep's best tile
#   OUT=dir bash benchmarks/gpu_s15.sh fourth  # the rest step reads bf16 gradients as stored (one norm launch): rest /
#                                            # clip / graph tests compiled; update tiles around 32 x 64 (bf16), and for
#                                            # fp32 states; part (b) graphed at B = 1, 4, 16: torch bf16, FORGE SR and RTN
#   OUT=dir bash benchmarks/gpu_s15.sh fifth   # the update tiles by W / state bytes (heuristic_config): tests compiled;
#                                            # part (b) graphed at B = 1, 4, 16 (torch bf16, FORGE SR / RTN); the 1b
#                                            # trainer graphed (baseline, FORGE); tune_kernels forge_split
#   OUT=dir bash benchmarks/gpu_s15.sh sixth   # 8-bit epilogue: scales per block, encoder compiled per map sign: tests
#                                            # compiled; tune_kernels forge_int8; part (b) eager at B = 16 (torch bf16,
#                                            # FORGE bf16 / fp32 / int8 states); int8 graphed at B = 1, 4; the 1b trainer
#                                            # with FORGE eager
# Work goes to /tmp/s15w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s15w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s15w "$PART"; }
forgeb_cfg() {  # $1 name, $2 limit, $3 batches (quoted list), rest: configurations
  local name=$1 lim=$2 batches=$3
  shift 3
  log "forge part (b) $name: B = $batches: $* ${LEANTRAIN_FORGE_TILE:-}"
  timeout "$lim" python3 benchmarks/bench_forge.py --part b --batches $batches --timeout 70 --configs "$@" \
    --out "$D/$name" 2>&1 | grep -v Warn | tail -12
}
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
    second)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, graphs (compiled)"
      gputest 240 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/test_graphs.py
      snap
      log "tune forge_update16"
      timeout 150 python3 benchmarks/tune_kernels.py --what forge_update16 --out "$D" 2>&1 | grep -v Warn | tail -8
      snap
      best=$(python3 -c "
import json; t = json.load(open('$D/tune_forge_update16.json'))['rows'][-1]['per_step_ms_1b_fused_layers']
t.pop('torch'); bn, bk, w = min(t, key=t.get).split('x'); print(f'{bn},{bk},16,{w},1')")
      log "best update tile over the 1b layers: $best"
      forgeb_cfg b_default 200 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_TILE=$best forgeb_cfg b_best 120 "1 4" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_TILE=$best prof forge_bf16_states_bf16_dw 1 --graph
      snap ;;
    third)
      gpuinfo
      log "tune forge_update16: smaller tiles / more warps (fewer registers a thread)"
      TUNE_UPDATE16_TILES="64,64,8;64,64,16;32,64,8;32,64,4;16,64,4;16,64,2;16,128,4;32,128,8;32,128,16;64,128,16;64,64,8,80;64,64,8,64" \
        timeout 150 python3 benchmarks/tune_kernels.py --what forge_update16 --out "$D" 2>&1 | grep -v Warn | tail -3
      snap
      best=$(python3 -c "
import json; t = json.load(open('$D/tune_forge_update16.json'))['rows'][-1]['per_step_ms_1b_fused_layers']
t.pop('torch'); v = min(t, key=t.get).split('x'); print(','.join(v[:2] + ['16', v[2], '1'] + v[3:]))")
      log "best update tile over the 1b layers: $best"
      forgeb_cfg b_torch 200 "1 4 16" torch_bf16_graph
      snap
      LEANTRAIN_FORGE_TILE=$best forgeb_cfg b_best 200 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap ;;
    fourth)
      gpuinfo
      log "gpu tests: rest kernel (bf16 gradients as stored, one norm launch), clip, graphs (compiled)"
      gputest 200 tests/forge/test_forge_rest_kernel.py tests/forge/test_forge_clip.py tests/test_graphs.py
      snap
      log "tune forge_update16 around 32 x 64 (bf16 W, bf16 states)"
      TUNE_UPDATE16_TILES="32,64,8;32,64,16;16,64,8;16,128,8;32,32,4;64,32,8;16,64,4;32,64,8,48;32,128,16;16,256,8;64,64,16" \
        timeout 120 python3 benchmarks/tune_kernels.py --what forge_update16 --out "$D" 2>&1 | grep -v Warn | tail -1
      for prec in wbf16_sfp32 wfp32_sfp32; do
        log "tune forge_update16 $prec"
        TUNE_TAG=_$prec TUNE_UPDATE16_PREC=$prec TUNE_UPDATE16_TILES="64,64,8;32,64,8;64,64,16;16,64,4;32,128,16;32,64,16" \
          timeout 100 python3 benchmarks/tune_kernels.py --what forge_update16 --out "$D" 2>&1 | grep -v Warn | tail -1
      done
      snap
      best=$(python3 -c "
import json; t = json.load(open('$D/tune_forge_update16.json'))['rows'][-1]['per_step_ms_1b_fused_layers']
t.pop('torch'); v = min(t, key=t.get).split('x'); print(','.join(v[:2] + ['16', v[2], '1'] + v[3:]))")
      log "best update tile over the 1b layers: $best"
      forgeb_cfg b_torch 150 "1 4 16" torch_bf16_graph
      snap
      LEANTRAIN_FORGE_TILE=$best forgeb_cfg b_best 240 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_rtn_bf16_states_bf16_dw_graph
      snap ;;
    fifth)
      gpuinfo
      log "gpu tests: rest kernel, device scalars, graphs, FORGE model tests (compiled, the new update tiles)"
      gputest 150 tests/forge/test_forge_rest_kernel.py tests/forge/test_forge_device_scalars.py tests/test_graphs.py \
        tests/forge/test_forge_kernel.py -k "model or update or last or direct or 32_bit"
      snap
      forgeb_cfg b_default 200 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_rtn_bf16_states_bf16_dw_graph
      snap
      train1b baseline_graph --baseline --train.cuda-graph true
      train1b forge_graph --forge --train.cuda-graph true
      snap
      log "tune forge_split (part (a)'s comparison, T = 512 / 1024 / 2048)"
      timeout 120 python3 benchmarks/tune_kernels.py --what forge_split --out "$D" 2>&1 | grep -v Warn | tail -1 | cut -c1-300
      snap ;;
    sixth)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, graphs (compiled; 8-bit encoder per map sign)"
      gputest 200 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/test_graphs.py
      snap
      log "tune forge_int8 (update tiles, int8 and fp32 states)"
      timeout 100 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | grep -v Warn | tail -1 | cut -c1-200
      snap
      forgeb_cfg b16 150 16 torch_bf16 forge_bf16_sr_bf16_states_bf16_dw forge_bf16_sr_fp32_states forge_bf16_sr_int8_states
      snap
      forgeb_cfg b14_int8 80 "1 4" forge_bf16_sr_int8_states_graph
      snap
      train1b forge --forge
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap
