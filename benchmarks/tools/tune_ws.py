"""Probe FORGE's warp-specialized Gluon kernel (``forge/ws.py``) on one Hopper GPU.

    PYTHONPATH=src python3 benchmarks/tools/tune_ws.py check            # bits: fused == its dW + the update kernel
    PYTHONPATH=src python3 benchmarks/tools/tune_ws.py time [--shapes ...] [--tokens ...] [--configs ...]
    PYTHONPATH=src python3 benchmarks/tools/tune_ws.py trace [--shapes ...] [--tokens ...] [--configs ...]

``check``: for every rule, fp32 W / states and bf16 W + SR with bf16 states, odd shapes and T not a
multiple of the token step, the kernel's fused update equals, bit for bit, its own dW (MODE 1)
followed by the update-only kernel of ``kernel.py``; its dW is within fp32 summation error of
``dYᵀX`` in fp32. ``time``: the kernel against torch (matmul + AdamW(fused=True)) and FORGE's split
path (cuBLAS dW into an fp32 buffer + the update kernel), fp32 W / m / v, as CUDA-graph replays
(``do_bench_cudagraph``: GPU time), ``do_bench`` medians and the CPU time a call (``host_us``); ``split16``
is the split path with ``grad_dtype="bf16"`` (the bf16 matmul's dW), the baseline for ``DW16`` configs
(``auto16``: ``auto_config`` with bf16 dW). Prints one JSON line per case.
``trace``: one fused launch (after warm-up) with the kernel's clock stamps (``launch_ws(trace=...)``):
how long each program's GEMMs, its waits for the dW slot, its updates and its waits for dW take, summed
over its tiles, and when the programs finish (the last wave's tail).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import forge_probes  # noqa: E402  (benchmarks/tools, the script's directory)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def check(args) -> int:
    import torch

    from leantrain.forge import ws
    from leantrain.forge.launch import scalars as _scalars

    assert ws.available(), "no sm_90 GPU or no Gluon"
    bad = 0
    cases = [(2048, 5632, 1024), (136, 264, 100), (256, 384, 64), (1024, 2048, 333)]
    configs = [json.loads(c) for c in args.configs] if args.configs else [{}]
    for config in configs:  # (other than the default: AdamW and Lion, every shape and dtype)
        rules = ("adamw", "sgd", "nesterov", "lion", "adams") if not config else ("adamw", "lion")
        for n, k, t in cases:
            for rule in rules:
                for wdt, sdt in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")):
                    if rule != "adamw" and (n, k, t) != (136, 264, 100):
                        continue
                    r = forge_probes.check(n, k, t, rule, wdt, sdt, config=config)
                    # (DW16: dW rounded to bf16, within half a bf16 ulp of the largest entry)
                    tol = 2.0**-8 if config.get("DW16") else 1e-5
                    ok = r["bitwise"] and r["dw_rel_err"] < tol and r["moved"] > 0 and r.get("dw_is_bf16", True)
                    bad += not ok
                    print(json.dumps({"check": [n, k, t], "config": config, "rule": rule, "w": wdt, "states": sdt,
                                      **r, "ok": ok}), flush=True)
    # a non-finite tile keeps its W and state
    n, k, t = 256, 256, 128
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    dy[5, 3] = float("nan")
    w = torch.randn(n, k, device="cuda")
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    w0 = w.clone()
    scal, flags = _scalars("adamw", forge_probes.RULE_HP["adamw"], 1)
    ws.launch_ws(0, x=x, dy=dy, w=w, states=[m, v], kinds=["fp32", "fp32"], scal=scal, flags=flags, rule_id=1)
    torch.cuda.synchronize()
    kept = torch.equal(w[:128], w0[:128]) and not torch.equal(w[128:], w0[128:]) and bool(torch.isfinite(w).all())
    bad += not kept
    print(json.dumps({"check": "nan_tile", "ok": kept}), flush=True)
    print(json.dumps({"check_failures": bad}), flush=True)
    return int(bad > 0)


def _launch_args(c, shape=None):
    """A ``--configs`` entry as ``launch_ws``'s ``config``, mode and ``dw_bf16``: None / ``"auto16"``
    are ``auto_config``'s schedule for the shape with fp32 / bf16 dW; a dict's ``"MODE"`` is the launch
    mode (1 writes dW; the probes 2 and 3), and its ``"AUTO"`` (32 or 16) starts from ``auto_config``'s
    schedule for ``shape`` (N, K, T) with fp32 / bf16 dW, the dict's other keys overriding it."""
    if c in (None, "auto16"):
        return None, 0, c == "auto16"
    c = dict(c)
    auto = c.pop("AUTO", 0)
    if auto:
        from leantrain.forge import ws

        n, k, t = shape
        c = {**ws.auto_config(n, k, t, ws._num_sms(0), dw_bf16=auto == 16), **c}
    return c, c.pop("MODE", 0), auto == 16


def _time_case(n, k, t, configs, hp, scal, flags, dtype="fp32") -> None:
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    from leantrain.forge import ws
    from leantrain.forge.launch import MODE_UPDATE, RULE_IDS, launch_forge
    from leantrain.ops._backend import mm_fp32

    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    # dtype "bf16": bf16 W (stochastic rounding) and bf16 m / v, against torch's pure-bf16 AdamW
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    kinds = [dtype, dtype]
    w = (torch.randn(n, k, device="cuda") * 0.02).to(dt)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    buf = torch.empty(n, k, device="cuda")
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
                            capturable=True)

    def baseline():
        p.grad = torch.matmul(dy.t(), x).to(dt)
        opt.step()
        p.grad = None

    def split():
        mm_fp32(dy.t(), x, buf, allow_upcast=True)
        launch_forge(MODE_UPDATE, g=buf, w=w, states=[m, v], kinds=kinds, rule_name="adamw",
                     hp=hp, step=10)

    def mm():  # (the split path's dW alone: what the GEMM costs on its own)
        mm_fp32(dy.t(), x, buf, allow_upcast=True)

    buf16 = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)

    def split16():  # (the split path with grad_dtype="bf16": the bf16 matmul's dW, read by the update kernel)
        torch.mm(dy.t(), x, out=buf16)
        launch_forge(MODE_UPDATE, g=buf16, w=w, states=[m, v], kinds=kinds, rule_name="adamw",
                     hp=hp, step=10)

    fns = {"torch": baseline, "split": split, "mm": mm, "split16": split16}
    # (a config's "MODE": 1 times the kernel writing dW to an fp32 buffer instead; the probes 2 the GEMM alone,
    # 3 the update alone, as launch_ws runs them)
    for i, c in enumerate(configs):
        c, mode, dw16 = _launch_args(c, (n, k, t))
        fns[f"ws{i}"] = (lambda c=c, mode=mode, dw16=dw16: ws.launch_ws(
            mode, x=x, dy=dy, w=w, states=[m, v], kinds=kinds, g=buf, scal=scal, flags=flags,
            rule_id=RULE_IDS["adamw"], config=c, dw_bf16=dw16))
    row = {"N": n, "K": k, "T": t, "dtype": dtype, "configs": configs}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            row[f"{name}_graph_ms"] = do_bench_cudagraph(fn, rep=40)
            row[f"{name}_ms"] = do_bench(fn, warmup=10, rep=40)
            torch.cuda.synchronize()  # (the CPU time a call of back-to-back calls: Python + launches)
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            row[f"{name}_host_us"] = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    for name in fns:
        if name != "torch" and row.get(f"{name}_graph_ms"):
            row[f"torch_over_{name}_graph"] = row["torch_graph_ms"] / row[f"{name}_graph_ms"]
            row[f"torch_over_{name}"] = row["torch_ms"] / row[f"{name}_ms"]
    print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}),
          flush=True)
    torch.cuda.empty_cache()


def _trace_case(n, k, t, configs, scal, flags) -> None:
    import torch

    from leantrain.forge import ws
    from leantrain.forge.launch import RULE_IDS

    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    w = torch.randn(n, k, device="cuda") * 0.02
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for c in configs:
        c, mode, dw16 = _launch_args(c, (n, k, t))
        kw = dict(x=x, dy=dy, w=w, states=[m, v], kinds=["fp32", "fp32"], scal=scal, flags=flags,
                  rule_id=RULE_IDS["adamw"], config=c, dw_bf16=dw16)
        for _ in range(5):
            ws.launch_ws(mode, **kw)
        tr = {}
        ws.launch_ws(mode, trace=tr, **kw)
        torch.cuda.synchronize()
        st = tr["stamps"]
        valid = st[:, :, 0] > 0  # (a program's slots past its last tile stay 0)
        t0 = st[:, :, 0][valid].min()
        us = (st - t0).double() / 1e3  # (differences in int64: the clock's ~1.8e18 ns lose 256 ns in a double)
        z = torch.zeros_like(us[:, :, 0])
        gemm = torch.where(valid, us[:, :, 1] - us[:, :, 0], z).sum(1)
        slot_wait = torch.where(valid, us[:, :, 2] - us[:, :, 1], z).sum(1)
        upd = torch.where(valid, us[:, :, 4] - us[:, :, 3], z).sum(1)
        prev_end = torch.cat([torch.zeros_like(us[:, :1, 4]), us[:, :-1, 4]], 1)
        dw_wait = torch.where(valid, us[:, :, 3] - prev_end, z).sum(1)
        end = torch.where(valid, us[:, :, 4], z).max(1).values
        tiles = valid.sum(1)

        def q(a):
            return [round(float(a.min()), 2), round(float(a.median()), 2), round(float(a.max()), 2)]

        print(json.dumps({"N": n, "K": k, "T": t, "config": c, "dw16": dw16, "mode": mode, "programs": int(st.shape[0]),
                          "tiles_per_program": q(tiles.double()), "span_us": round(float(end.max()), 2),
                          "end_us": q(end), "first_gemm_us": q(us[:, 0, 1] - us[:, 0, 0]),
                          "gemm_us": q(gemm), "slot_wait_us": q(slot_wait), "update_us": q(upd),
                          "dw_wait_us": q(dw_wait), "note": "per program, summed over its tiles: [min, median, max]"}),
              flush=True)


def time_cases(args) -> int:
    from leantrain.forge.launch import scalars as _scalars

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    scal, flags = _scalars("adamw", hp, 10)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    configs = ([None if c == "auto" else c if c == "auto16" else json.loads(c) for c in args.configs]
               if args.configs else [{}])
    for n, k in shapes:
        for t in tokens:
            if args.what == "trace":
                _trace_case(n, k, t, configs, scal, flags)
            else:
                _time_case(n, k, t, configs, hp, scal, flags, args.dtype)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["check", "time", "trace"])
    ap.add_argument("--shapes", default="2048x2048,2048x5632,5632x2048,32000x2048")
    ap.add_argument("--tokens", default="512,1024,2048,4096,16384")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="time: W and the AdamW states in fp32, or bf16 (W with stochastic rounding; torch: pure bf16)")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="JSON dicts overriding ws.WS_CONFIG, or auto / auto16 (ws.auto_config for each shape, "
                         "fp32 / bf16 dW)")
    args = ap.parse_args()
    return check(args) if args.what == "check" else time_cases(args)


if __name__ == "__main__":
    sys.exit(main())
