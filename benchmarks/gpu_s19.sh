#!/usr/bin/env bash
# Session 19's GPU calls (results/2026-12-02_H200_s19/). The grouped updates that first .. third measure were
# removed after them (their code: commit 155568d): those parts are the record of what ran, not runnable on main.
#   OUT=dir bash benchmarks/gpu_s19.sh first   # grouped updates (attach(group_updates=True)): the group tests
#                                            # compiled (bit-identical to one launch a layer, eager and graphed),
#                                            # then part (b) graphed at B = 1, 4: torch, FORGE, FORGE grouped,
#                                            # alternating; B = 16 once each; int8p grouped
#   OUT=dir bash benchmarks/gpu_s19.sh second  # why grouped was slower: the grouped kernel alone (tune forge_group)
#                                            # and profiles of B = 1, eager and graphed, with and without grouping
#   OUT=dir bash benchmarks/gpu_s19.sh fourth  # the whole suite compiled on the GPU, after the removal
#   OUT=dir bash benchmarks/gpu_s19.sh third   # the grouped kernel's launch shapes (tiles a program, grid2d, a
#                                            # register cap): group tests, tune forge_group, part (b) at B = 1, 4
# Work goes to /tmp/s19w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s19w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: grouped updates, graphs, device scalars (compiled)"
      gputest 240 tests/forge/test_forge_group.py tests/test_graphs.py tests/forge/test_forge_device_scalars.py
      snap
      forgeb_cfg b_ab 330 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_group_graph torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_group_graph
      snap
      forgeb_cfg b16 150 "16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_group_graph forge_bf16_sr_int8p_states_group_graph
      snap ;;
    second)  # why grouped was slower (first/: 24.0 against 20.5 ms at B = 1): the grouped kernel alone, and profiles
      log "tune forge_group: per layer, per block, three, and the grouped kernel a block"
      timeout 150 python3 benchmarks/tune_kernels.py --what forge_group --out "$D" 2>&1 | grep -v Warn | tail -5
      snap
      prof forge_bf16_states_bf16_dw 1
      prof forge_bf16_states_bf16_dw 1 --group
      prof forge_bf16_states_bf16_dw 1 --group --graph
      prof forge_bf16_states_bf16_dw 1 --graph
      snap ;;
    fourth)  # after the removal: the whole suite compiled on the GPU (LEANTRAIN_TEST_GPU=1, GPU tests included),
      # the FORGE / kernel directories first; one line a test in suite.txt (what a time-out leaves comes back)
      gpuinfo
      log "the whole test suite, compiled"
      LEANTRAIN_TEST_GPU=1 timeout 530 python3 -m pytest -v -p no:cacheprovider -o addopts="" -m "not benchmark" \
        -rfE --durations=25 tests/forge tests/test_graphs.py tests/test_optim.py tests/ops tests/agoq tests/comm tests/dist \
        tests/test_losses.py tests/test_model.py tests/test_checkpointing.py tests/test_trainer.py tests/test_torchrun.py \
        tests/test_config.py tests/test_data.py tests/test_ledger.py tests/test_sass_count.py \
        > "$D/suite.txt" 2>&1
      echo "rc=$?" >> "$D/suite.txt"
      tail -40 "$D/suite.txt" ;;
    third)  # the grouped kernel reads a program's layer once for several tiles, or takes it from the grid
      gpuinfo
      log "gpu tests: grouped updates (compiled)"
      gputest 200 tests/forge/test_forge_group.py
      snap
      log "tune forge_group: launch shapes (tiles, grid2d, maxnreg)"
      timeout 200 python3 benchmarks/tune_kernels.py --what forge_group --out "$D" 2>&1 | grep -v Warn | tail -13
      snap
      forgeb_cfg b_default 150 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_group_graph
      snap
      for sh in 4,1,64 8,1,64 2,1,0; do
        LEANTRAIN_FORGE_GROUP_LAUNCH=$sh forgeb_cfg "b_${sh//,/_}" 60 "1 4" forge_bf16_sr_bf16_states_bf16_dw_group_graph
        snap
      done ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap
