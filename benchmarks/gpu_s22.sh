#!/usr/bin/env bash
# Session 22's GPU calls:
#   OUT=dir bash benchmarks/gpu_s22.sh first   # the persistent fused kernel (forge/persist.py) against torch and
#                                            # the split path at the 1b shapes, T = 512 / 1024 / 2048, fp32 and
#                                            # bf16 W (tune_kernels.py --what forge_persist); its bits checked
#   OUT=dir bash benchmarks/gpu_s22.sh second  # the same kernel: each half alone, staggered programs, other tiles
#                                            # (the STAGGER / PHASES knobs of commit 1ed81e2)
#   OUT=dir bash benchmarks/gpu_s22.sh third   # producer programs (the GEMM) and consumer programs (the update)
#   OUT=dir bash benchmarks/gpu_s22.sh fourth  # zeroth-order fine-tuning (MeZO, GRZO) against back-propagation
#                                            # (run with carry runs/s22pre: a tiny run of make train, 300 steps)
#   OUT=dir bash benchmarks/gpu_s22.sh fifth   # the same after the fix of finetune's peak (fourth read it after
#                                            # the final evaluation's forwards) and MeZO's default lr 3e-4
#   OUT=dir bash benchmarks/gpu_s22.sh sixth   # the same with the noise block sized by the model (2**22 at 1b):
#                                            # timed out packing the 1b checkpoints finetune now writes; nothing back
#   OUT=dir bash benchmarks/gpu_s22.sh seventh # 1b MeZO and GRZO only, checkpoints deleted before packing
# The persistent kernel (src/leantrain/forge/persist.py) and its tuner (tune_kernels.py --what forge_persist) were
# removed after these calls (slower than the split path): second ran the code of commit 1ed81e2, first the same
# kernel before its two measurement knobs (off by default) were added, third
# that of 0be4434; check one out to run them again.
# Work goes to /tmp/s22w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s22w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      for prec in fp32 bf16; do
        log "persist probe $prec"
        TUNE_SPLIT_PRECS=$prec TUNE_TAG=_$prec timeout 240 python3 benchmarks/tune_kernels.py --what forge_persist \
          --out "$D" 2>&1 | grep -v Warn | cut -c1-900 | tail -14
        snap
      done ;;
    second)  # where the persistent kernel's time goes: each half alone (PHASES 1 / 2), the second half of the
      # programs started late (STAGGER ns: are two programs of an SM in lock step?), other slices and tiles
      B=128,128,64,8,3,32,2,1,128
      C="$B;$B,0,1;$B,0,2;$B,3000,3;$B,8000,3;128,128,64,8,3,16,2,1,128;128,128,64,8,3,64,2,1,128"
      C="$C;128,128,64,4,3,16,2,1,0,0,1;128,128,64,8,3,32,1,1,0,0,1;128,256,64,8,3,32,1,1,0,0,1"
      C="$C;128,128,64,8,4,32,1,1,0,0,1;128,128,64,8,3,32,1,1,0,0,2"
      for prec in fp32 bf16; do
        log "persist probe $prec: $C"
        TUNE_PERSIST_CFGS="$C" TUNE_PERSIST_SHAPES=2048x5632,32000x2048 TUNE_PERSIST_T=512,2048 TUNE_SPLIT_PRECS=$prec \
          TUNE_TAG=_$prec timeout 200 python3 benchmarks/tune_kernels.py --what forge_persist --out "$D" 2>&1 \
          | grep -v Warn | cut -c1-300 | tail -5
        snap
      done ;;
    third)  # producer and consumer programs: one an SM computes gradients into a ring of slots in L2, one or
      # two an SM update from them (ROLES, RING), against the best program-does-both tile of first/
      C="128,128,64,8,3,32,2,1,128;128,128,64,8,3,32,1,1,128,1,2;128,128,64,4,3,16,1,1,0,1,2"
      C="$C;128,128,64,4,2,16,1,1,168,2,4;128,128,64,8,3,32,1,1,128,1,4;128,128,64,4,3,32,1,1,0,1,2"
      C="$C;128,128,64,4,2,16,1,1,0,1,2"
      for prec in fp32 bf16; do
        log "persist probe $prec: $C"
        TUNE_PERSIST_CFGS="$C" TUNE_SPLIT_PRECS=$prec TUNE_TAG=_$prec timeout 200 python3 benchmarks/tune_kernels.py \
          --what forge_persist --out "$D" 2>&1 | grep -v Warn | cut -c1-300 | tail -13
        snap
      done ;;
    fourth|fifth|sixth)  # zeroth-order fine-tuning on the H200 (fifth: again, the peak read before the final
      # evaluation; sixth: the noise block 1/256 of the trained elements within [2**16, 2**22], was 2**18). The tiny run of this session (make train with STEPS=300, carried
      # as runs/s22pre): compare task, MeZO / GRZO / back-propagation at their default learning rates, 3 seeds.
      # Then the 1b preset from random weights, 10 steps each: the allocator's peak against inference's.
      gpuinfo
      log "finetune: tiny, compare, 3 seeds"
      timeout 240 python3 benchmarks/bench_finetune.py --from runs/s22pre --task compare --methods mezo:3e-4 \
        grzo:1e-5 full:1e-4 --out "$D/tiny" 2>&1 | tail -8
      rm -rf "$D/tiny/runs"
      snap
      for m in mezo grzo full; do
        log "finetune: 1b, random weights, $m"
        timeout 150 python3 -m leantrain finetune --method $m --task compare --preset 1b --steps 10 --batch-size 16 \
          --eval-examples 64 --log-every 5 --out "$D/b1_$m" --data.max-corpus-mb 6 2>&1 | tail -2
        snap
      done ;;
    seventh)  # the 1b zeroth-order steps with the noise block of the final code (2**22 at 1b), MeZO and GRZO only;
      # each run's checkpoint (4.4 GB) deleted before the snapshot (sixth timed out packing them)
      for m in grzo mezo; do
        log "finetune: 1b, random weights, $m"
        timeout 90 python3 -m leantrain finetune --method $m --task compare --preset 1b --steps 10 --batch-size 16 \
          --eval-examples 64 --log-every 5 --out "$D/b1_$m" --data.max-corpus-mb 6 2>&1 | tail -2
        rm -rf "$D/b1_$m/checkpoints"
        snap
      done ;;
  esac
} 2>&1 | tee -a "$D/log.txt"
snap
