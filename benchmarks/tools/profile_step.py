"""Profile one training step of the 1b preset (torch.profiler tables, for finding overhead).

    PYTHONPATH=src python3 benchmarks/tools/profile_step.py --config forge_bf16 --batch 4 --out DIR

configs: torch_bf16 (AdamW fused, pure bf16), forge_bf16 (FORGE bf16+SR, fp32 states),
forge_bf16_states (bf16 states), forge_bf16_states_bf16_dw (and bf16 dW), agoq (bf16, AdamW fused,
AGoQ default policy), agoq_forge; a ``_fp`` / ``_fp_sw`` / ``_sw`` suffix sets ``model.fused_proj`` /
both / ``model.fused_swiglu``, as in ``bench_forge.py``. ``--graph``: forward + backward (and FORGE's update) replayed
from a CUDA graph (``lt.runtime.capture.GraphedStep``, captured after the eager warm-up), ``opt.step()``
after it, as ``bench_forge.py``'s ``*_graph`` configurations. Writes ``profile_<config>.txt``:
wall time per step (median of 5), then the top operators by CUDA and by CPU time; with
``--cprofile`` also ``cprofile_<config>_b<B>.txt``, the host's Python time by function.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-opt", action="store_true", help="forward + backward only (as bench_agoq times it)")
    ap.add_argument("--cprofile", action="store_true", help="also a Python cProfile of 3 steps (host time by function)")
    ap.add_argument("--graph", action="store_true", help="replay forward + backward from a CUDA graph")
    ap.add_argument("--clip", default="none", help="forge configs: FORGE's clip mode (est_global: the trainer's default)")
    a = ap.parse_args(argv)
    from bench_forge import set_layout

    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama

    torch.manual_seed(0)
    cfg = preset(a.preset).model
    cfg.max_seq_len = max(cfg.max_seq_len, a.seq)
    config = set_layout(cfg, a.config)
    with torch.device("cuda"):
        model = Llama(cfg).to(torch.bfloat16)
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if "forge" in config:
        opt = lt.forge.attach(model, lt.optim.AdamW(**kw), state_dtype="bf16" if "bf16_states" in config else "fp32",
                              stochastic_rounding=True, clip=a.clip,
                              grad_dtype="bf16" if config.endswith("_bf16_dw") else "fp32")
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    if "agoq" in config:
        lt.agoq.apply(model, lt.agoq.Policy())
    g = torch.Generator(device="cuda").manual_seed(0)

    fwd = []
    graph = []

    def step():
        idx = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda", generator=g)
        t0 = time.perf_counter()
        if graph:
            graph[0](idx[:, :-1], idx[:, 1:])
            fwd.append((time.perf_counter() - t0) * 1e3)
        else:
            loss = model(idx[:, :-1], idx[:, 1:])
            fwd.append((time.perf_counter() - t0) * 1e3)
            loss.backward()
        if not a.no_opt:
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if a.graph:
        from leantrain.runtime.capture import GraphedStep

        idx = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda", generator=g)
        graph.append(GraphedStep(model, model.parameters(), idx[:, :-1], idx[:, 1:]))
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    times, issue = [], []
    fwd.clear()
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        issue.append((time.perf_counter() - t0) * 1e3)  # host time to issue the step's work
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    os.makedirs(a.out, exist_ok=True)
    tag = f"{'_graph' if a.graph else ''}{'_noopt' if a.no_opt else ''}{'' if a.clip == 'none' else '_' + a.clip}"
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]  # (GPU-side ranges such as Optimizer.step: not work)
    busy = sum(e.device_time for e in kernels) / 1e3  # ms, the step's kernels and copies back to back
    with open(os.path.join(a.out, f"profile_{a.config}_b{a.batch}{tag}.txt"), "w") as f:
        f.write(f"{a.config}{' (graphed)' if a.graph else ''} B={a.batch} T={a.seq}: step ms median "
                f"{statistics.median(times):.1f} all {times}\n"
                f"device ms in the profiled step: {busy:.2f} over {len(kernels)} kernels / copies\n"
                f"host issue ms median {statistics.median(issue):.1f} (a step is host-bound when this is"
                f" close to the step time); of it the forward {statistics.median(fwd[:5]):.1f}\n\n")
        f.write(ka.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        f.write("\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if a.cprofile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        pr.disable()
        with open(os.path.join(a.out, f"cprofile_{a.config}_b{a.batch}.txt"), "w") as f:
            packer = lt.agoq.packer_of(model)
            if packer is not None:
                f.write(f"AGoQ packer stats (all steps so far): {dict(packer.stats)}\n")
            st = pstats.Stats(pr, stream=f)
            st.sort_stats("tottime").print_stats(40)
            st.sort_stats("cumulative").print_stats(40)
    print(a.config, a.batch, "step ms", statistics.median(times), "issue ms", statistics.median(issue),
          "forward issue ms", statistics.median(fwd[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
