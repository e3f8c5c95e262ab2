"""FORGE benchmarks on one CUDA GPU (written for an H200).

    PYTHONPATH=src python3 benchmarks/bench_forge.py --out benchmarks/results [--quick] [--part a|b|all|sass]

(a) One linear layer, shapes of the 1b preset (N x K), T tokens: FORGE's fused dW + AdamW
    update (fp32 W/m/v, bf16 X/dY) against ``torch.matmul`` (bf16 dYᵀX, cast to fp32) +
    ``torch.optim.AdamW(fused=True)`` on the materialized gradient; also FORGE's split path
    (cuBLAS dW into a reused fp32 buffer + the fused update kernel), the measured switch point
    between the two, and ForgeOptimizer's whole per-layer path ('layer'). Median times from
    ``triton.testing.do_bench`` (host launch overhead included), CUDA-graph replays
    (``do_bench_cudagraph``: GPU time only) and the host CPU time per call of back-to-back
    calls; bytes moved
    (X + dY read once, W/m/v read and written) against the HBM floor at the *measured*
    copy bandwidth of this GPU. On an sm_90 GPU also the warp-specialized Gluon kernel
    (``forge/ws.py``) alone ('ws') and through ForgeOptimizer ('layer_ws', ``ws_tokens``). With a bf16
    dW, the baseline's own precision (``grad_dtype="bf16"``): the split path ('split16') and the Gluon
    kernel handing its tile over in bf16 ('ws16'); both kernels with ``fast_math`` ('ws_fast', 'ws16_fast').
(b) A whole training step of the ``1b`` preset, T = 1024 tokens per sequence, B sequences:
    torch AdamW fused with fp32 master weights + bf16 autocast; torch AdamW fused, pure bf16;
    PyTorch optimizer-in-backward (``register_post_accumulate_grad_hook``, bf16); FORGE fp32
    (+ autocast); FORGE bf16 weights + SR with fp32 states; FORGE bf16 + SR with int8 states.
    Each configuration runs in a fresh subprocess (peaks do not mix; part (a) too). Tile shapes
    come from FORGE's fixed heuristic (no autotuning), so warm-up is compilation only
    (reported per configuration as ``warmup_s``). Reports peak memory,
    memory held between steps, peak above it, median step time; OOM is caught and reported.
    ``--configs ..._graph``: the same step with forward + backward (and FORGE's update) replayed
    from a CUDA graph (``lt.runtime.capture.GraphedStep``), captured after the eager warm-up; its peak
    includes the graph's pool and, for torch, the gradients the graph keeps. ``..._ckpt``: with
    activation checkpointing per block (``model.activation_checkpointing``).

(sass) No GPU needed: the update-only kernel compiled for sm_90a with the launcher's constexprs and
    tiles (bf16 W + SR, AdamW, fp32 / bf16 / int8 / int8p / fp8 states), its SASS counted per element by
    instruction class, with registers, spills, shared memory and TTGIR layout conversions
    (``parts/update_sass.py``): ``<date>_<hardware>_update-sass.{json,md}``.

Writes ``<date>_<hardware>_{layer,step}.json`` and ``.md`` into ``--out``. Every configuration is
guarded: a failure is recorded with its error and the run continues.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from parts import steprun  # noqa: E402

SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048), (32000, 2048)]
TOKENS = [512, 1024, 2048, 4096, 16384]
STEP_CONFIGS = ["torch_fp32_master_autocast", "torch_bf16", "torch_optim_in_backward_bf16", "forge_fp32",
                "forge_bf16_sr_fp32_states", "forge_bf16_sr_int8_states"]
# FORGE as it is meant to be used: composed with AGoQ (saved activations at ~4 bits); run on request
EXTRA_CONFIGS = ["forge_bf16_sr_int8_states_agoq",
                 # the state precision of torch's pure-bf16 AdamW (its states take the weights' dtype)
                 "forge_bf16_sr_bf16_states",
                 # and torch's gradient precision too: the split path's dW in bf16 (grad_dtype="bf16")
                 "forge_bf16_sr_bf16_states_bf16_dw",
                 # and torch's rounding: bf16 weights rounded to nearest (no SR): torch bf16's numerics exactly
                 "forge_bf16_rtn_bf16_states_bf16_dw", "forge_bf16_rtn_bf16_states_bf16_dw_graph",
                 # forward + backward captured as one CUDA graph (lt.runtime.capture.GraphedStep; FORGE's update
                 # inside it), then opt.step() for the rest: the host-bound small batches
                 "torch_bf16_graph", "forge_bf16_sr_fp32_states_graph", "forge_bf16_sr_bf16_states_graph",
                 "forge_bf16_sr_int8_states_graph", "forge_bf16_sr_bf16_states_bf16_dw_graph",
                 # with activation checkpointing (model.activation_checkpointing): only the blocks'
                 # inputs kept, so what a step adds is the gradients (torch) or nothing (FORGE)
                 "torch_bf16_ckpt", "forge_bf16_sr_bf16_states_ckpt", "forge_bf16_sr_int8_states_ckpt",
                 # 8-bit states with each block's absmax packed into its codes' low bits (1 byte an element)
                 "forge_bf16_sr_int8p_states", "forge_bf16_sr_int8p_states_graph",
                 # 8-bit e4m3 states (int8's bytes, the GPU's own conversions instead of the map's arithmetic)
                 "forge_bf16_sr_fp8_states", "forge_bf16_sr_fp8_states_graph", "forge_bf16_sr_fp8_states_agoq",
                 # q/k/v and gate/up as one linear each (model.fused_proj): 4 FORGE updates a block, not 7
                 "torch_bf16_fp_graph", "forge_bf16_sr_bf16_states_bf16_dw_fp_graph", "torch_bf16_fp",
                 "forge_bf16_sr_bf16_states_bf16_dw_fp", "forge_bf16_sr_int8p_states_fp_graph",
                 # and SwiGLU as one function (model.fused_swiglu: gate and up saved, not silu(gate) too)
                 "torch_bf16_fp_sw_graph", "forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph", "torch_bf16_fp_sw",
                 "forge_bf16_sr_bf16_states_bf16_dw_fp_sw",
                 # SwiGLU as one function with the separate projections
                 "torch_bf16_sw_graph", "forge_bf16_sr_bf16_states_bf16_dw_sw_graph", "torch_bf16_sw",
                 "forge_bf16_sr_bf16_states_bf16_dw_sw"]
BATCHES = [1, 4, 16]


# ----------------------------------------------------------------------------- helpers


def _env() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "date": _dt.datetime.now().isoformat(timespec="seconds")}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _bandwidth() -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    import torch
    from triton.testing import do_bench

    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=10, rep=50)
    return 2 * (1 << 30) / (ms * 1e-3)


def _f(x, unit=""):
    return "" if x is None else f"{x:.3f}{unit}"


def _u(x):
    return "" if x is None else f"{x:.0f}"


def _gb(x):
    return None if x is None else round(x / 2**30, 3)


# ----------------------------------------------------------------------------- part (a)


def _forge_layer_fn(w, x, dy, dtype, **attach_kw):
    """ForgeOptimizer's whole per-layer path (state lookup, launch arguments, launch, norm sum) on
    an ``nn.Linear`` of ``dtype`` holding ``w``: (a function running one update, what it holds)."""
    import torch

    from leantrain.forge import attach
    from leantrain.optim import AdamW

    n, k = w.shape
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    fopt = attach(lin, AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), **attach_kw)
    layer = fopt.layers[0]

    def run():
        fopt._update_layer(layer, x, dy)
        fopt._step_id += 1  # the accumulation guard; step() closes nothing else that matters here
        fopt._ran.clear()

    return run, (lin, fopt)


def _product_fns(n: int, k: int, w, x, dy) -> tuple[dict, list]:
    """Part (a) with ``--product``: FORGE as recommended (bf16 W with stochastic rounding, int8
    AdamW states) through its per-layer path, split (default) and fused, and torch's pure-bf16
    AdamW (bf16 W, dW and states; ``fused=True``) on the materialized gradient."""
    import torch

    fns, keep = {}, []
    for name, split in (("layer_bf16_int8", 1), ("layer_bf16_int8_fused", None)):
        fns[name], held = _forge_layer_fn(w, x, dy, torch.bfloat16, split_tokens=split, state_dtype="int8",
                                          stochastic_rounding=True)
        keep.append(held)
    pb = torch.nn.Parameter(w.to(torch.bfloat16))
    optb = torch.optim.AdamW([pb], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
                             capturable=True)

    def torch_bf16():
        pb.grad = torch.matmul(dy.t(), x)
        optb.step()
        pb.grad = None

    fns["torch_bf16"] = torch_bf16
    keep.append((pb, optb))
    return fns, keep


# part (a)'s paths: a failure in one of them fails the benchmark (--product's extra columns only cost themselves)
_PATHS = ("fused", "split", "torch", "layer", "ws", "layer_ws", "split16", "ws16", "ws_fast", "ws16_fast")


def _layer_case(n: int, k: int, t: int, bw: float, quick: bool, product: bool = False) -> dict:
    import torch
    from triton.testing import do_bench

    from leantrain.forge import detach, ws
    from leantrain.forge.launch import MODE_FUSED, MODE_UPDATE, RULE_IDS, launch_forge
    from leantrain.forge.launch import scalars as _scalars
    from leantrain.ops._backend import mm_fp32

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    row = {"N": n, "K": k, "T": t}
    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    w = torch.randn(n, k, device="cuda") * 0.02
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    common = dict(w=w, states=[m, v], kinds=["fp32", "fp32"], rule_name="adamw", hp=hp, step=10)
    buf = torch.empty(n, k, device="cuda")
    p = torch.nn.Parameter(w.clone())
    # capturable: the step count lives on the GPU, so the CUDA-graph replay below is valid
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
                            capturable=True)

    def fused():
        launch_forge(MODE_FUSED, x=x, dy=dy, **common)

    def split():  # what ForgeOptimizer does from split_tokens on
        mm_fp32(dy.t(), x, buf, allow_upcast=True)
        launch_forge(MODE_UPDATE, g=buf, **common)

    def baseline():
        p.grad = torch.matmul(dy.t(), x).float()
        opt.step()
        p.grad = None

    buf16 = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)

    def split16():  # grad_dtype="bf16": the bf16 matmul's dW (the baseline's precision), read by the update kernel
        torch.mm(dy.t(), x, out=buf16)
        launch_forge(MODE_UPDATE, g=buf16, **common)

    forge_layer, (lin, _) = _forge_layer_fn(w, x, dy, torch.float32, split_tokens=None)
    cases = {"fused": fused, "split": split, "torch": baseline, "layer": forge_layer, "split16": split16}
    lin_ws = None
    if ws.available():  # the warp-specialized Gluon kernel (sm_90), alone and through ForgeOptimizer
        scal, flags = _scalars("adamw", hp, 10)

        def wsk(dw_bf16: bool, approx: bool):
            """The kernel alone: dw_bf16, the tile handed over in bf16 (grad_dtype="bf16",
            auto_config(dw_bf16=True)'s schedule); approx, fast_math's approximate sqrt / divisions."""
            return lambda: ws.launch_ws(MODE_FUSED, x=x, dy=dy, w=w, states=[m, v], kinds=["fp32", "fp32"],
                                        scal=scal, flags=flags, rule_id=RULE_IDS["adamw"], dw_bf16=dw_bf16,
                                        approx=approx)

        for name, dw_bf16, approx in (("ws", False, False), ("ws16", True, False), ("ws_fast", False, True),
                                      ("ws16_fast", True, True)):
            cases[name] = wsk(dw_bf16, approx)
        cases["layer_ws"], (lin_ws, _) = _forge_layer_fn(w, x, dy, torch.float32, ws_tokens=1 << 30)
    keep = []
    if product:
        extra, keep = _product_fns(n, k, w, x, dy)
        cases.update(extra)
    for name, fn in cases.items():
        try:
            fn()  # compile (fixed tile heuristic: nothing to autotune)
        except Exception as e:  # noqa: BLE001
            if name in _PATHS:
                raise
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]  # (--product: costs its columns only)
            product = False
            continue
        torch.cuda.synchronize()
        row[f"{name}_ms"] = do_bench(fn, warmup=5 if quick else 10, rep=20 if quick else 40)
        # host time per call: back-to-back calls, no synchronization inside the loop (the GPU
        # queue absorbs the launches), so this is the Python + launch cost on the CPU
        torch.cuda.synchronize()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        row[f"{name}_host_us"] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        try:  # GPU time without host launch overhead (CUDA graph replay)
            from triton.testing import do_bench_cudagraph

            row[f"{name}_graph_ms"] = do_bench_cudagraph(fn, rep=20 if quick else 40)
        except Exception as e:  # noqa: BLE001
            row[f"{name}_graph_ms"] = None
            row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.synchronize()
    detach(lin)
    if lin_ws is not None:
        detach(lin_ws)
    nbytes = t * (n + k) * 2 + n * k * 4 * 3 * 2
    floor_ms = max(nbytes / bw, 2 * t * n * k / 790e12) * 1e3
    paths = {p_: row[f"{p_}_ms"] for p_ in ("fused", "split", "ws") if f"{p_}_ms" in row}
    best_path = min(paths, key=paths.get)
    row.update(bytes=nbytes, floor_ms=floor_ms, speedup_fused=row["torch_ms"] / row["fused_ms"],
               speedup_dispatch=row["torch_ms"] / paths[best_path], best_path=best_path,
               fused_vs_floor=row["fused_ms"] / floor_ms)
    for p_ in (p for p in _PATHS if p not in ("fused", "torch", "layer")):  # (fused's ratios: above and below)
        if row.get(f"{p_}_ms"):
            row[f"speedup_{p_}"] = row["torch_ms"] / row[f"{p_}_ms"]
        if row.get(f"{p_}_graph_ms") and row.get("torch_graph_ms"):
            row[f"speedup_{p_}_graph"] = row["torch_graph_ms"] / row[f"{p_}_graph_ms"]
    if row.get("fused_graph_ms") and row.get("torch_graph_ms"):
        row["speedup_fused_graph"] = row["torch_graph_ms"] / row["fused_graph_ms"]
    if product:  # bf16 W + int8 states (2 + 2 * (1 + 4/256) B an element) read and written, X + dY once
        nb8 = t * (n + k) * 2 + n * k * (2 + 2 * (1 + 4 / 256)) * 2
        row.update(bytes_bf16_int8=nb8, floor_bf16_int8_ms=max(nb8 / bw, 2 * t * n * k / 790e12) * 1e3)
        for name in ("layer_bf16_int8", "layer_bf16_int8_fused"):
            row[f"torch_over_{name}"] = row["torch_ms"] / row[f"{name}_ms"]
            row[f"torch_bf16_over_{name}"] = row["torch_bf16_ms"] / row[f"{name}_ms"]
    del keep
    return row


def bench_layer(quick: bool, log, product: bool = False, tokens: list[int] | None = None) -> dict:
    import torch

    bw = _bandwidth()
    log(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s")
    shapes = SHAPES[:2] if quick else SHAPES
    tokens = tokens or ([512, 2048, 16384] if quick else TOKENS)
    rows = []
    for n, k in shapes:
        for t in tokens:
            try:
                row = _layer_case(n, k, t, bw, quick, product)
            except Exception as e:  # noqa: BLE001
                row = {"N": n, "K": k, "T": t, "error": f"{type(e).__name__}: {e}"}
                log(traceback.format_exc())
            torch.cuda.empty_cache()
            log(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}))
            rows.append(row)
    return {"bandwidth_bytes_per_s": bw, "rows": rows}


# ----------------------------------------------------------------------------- part (b)


def set_layout(cfg, config: str) -> str:
    """The model layout a configuration's suffix names, set in ``cfg`` (a ModelConfig): ``_sw``
    model.fused_swiglu, ``_fp`` model.fused_proj (``_fp_sw`` both; none: neither, the op-by-op
    layout). Returns the name without them."""
    cfg.fused_swiglu = config.endswith("_sw")
    config = config.removesuffix("_sw")
    cfg.fused_proj = config.endswith("_fp")
    return config.removesuffix("_fp")


def step_worker(config: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """One configuration of the whole-step benchmark (runs in its own process)."""
    import torch

    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama

    torch.manual_seed(0)
    cfg = preset("1b").model
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    graphed = config.endswith("_graph")
    config = config.removesuffix("_graph")
    cfg.activation_checkpointing = config.endswith("_ckpt")
    config = set_layout(cfg, config.removesuffix("_ckpt"))
    bf16_weights = config in ("torch_bf16", "torch_optim_in_backward_bf16", "forge_bf16_sr_fp32_states",
                              "forge_bf16_sr_int8_states", "forge_bf16_sr_int8_states_agoq",
                              "forge_bf16_sr_int8p_states", "forge_bf16_sr_fp8_states", "forge_bf16_sr_fp8_states_agoq",
                              "forge_bf16_sr_bf16_states", "forge_bf16_sr_bf16_states_bf16_dw",
                              "forge_bf16_rtn_bf16_states_bf16_dw")
    with torch.device("cuda"):
        model = Llama(cfg)
    if bf16_weights:
        model = model.to(torch.bfloat16)
    autocast = not bf16_weights
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = None
    if config in ("torch_fp32_master_autocast", "torch_bf16"):
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    elif config == "torch_optim_in_backward_bf16":
        opts = {p: torch.optim.AdamW([p], fused=True, **kw) for p in model.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
    else:
        state_dtype = ("int8" if "int8_states" in config else "int8p" if "int8p_states" in config
                       else "fp8" if "fp8_states" in config else "bf16" if "bf16_states" in config else "fp32")
        opt = lt.forge.attach(model, lt.optim.AdamW(**kw), state_dtype=state_dtype,
                              stochastic_rounding="_rtn_" not in config,
                              grad_dtype="bf16" if config.endswith("_bf16_dw") else "fp32")
        if config.endswith("_agoq"):
            lt.agoq.apply(model, lt.agoq.Policy())
    g = torch.Generator(device="cuda").manual_seed(0)

    def fwd(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(x, y)

    graph = []  # the GraphedStep, made after the eager warm-up

    def one_step():
        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda", generator=g)
        if graph:
            loss = graph[0](idx[:, :-1], idx[:, 1:])
        else:
            loss = fwd(idx[:, :-1], idx[:, 1:])
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    def capture():  # after the eager warm-up (optimizer states exist); its pool counts in the peak
        from leantrain.runtime.capture import GraphedStep

        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda", generator=g)
        graph.append(GraphedStep(fwd, model.parameters(), idx[:, :-1], idx[:, 1:]))
        for _ in range(2):
            one_step()

    # the warm-up includes Triton compilation (fixed tile heuristic: no autotuning)
    run = steprun.timed_steps(one_step, warmup=warmup, steps=steps, after_warmup=capture if graphed else None)
    from leantrain.runtime.ledger import count_bytes, tensors_in

    params = sum(p.numel() for p in model.parameters())
    states = list(opt.state.values()) if opt is not None else [o.state for o in opts.values()]
    state_bytes = count_bytes(tensors_in(states))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak, held = run["peak_bytes"], run["held_bytes"]
    return {"status": "ok", "step_ms": run["step_s"] * 1e3, "warmup_s": run["warmup_s"],
            "step_ms_all": [t * 1e3 for t in run["times"]],
            "peak_bytes": peak, "held_bytes": held, "above_held_bytes": peak - held,
            "weight_bytes": weight_bytes, "state_bytes": state_bytes,
            "persistent_bytes_per_param": (weight_bytes + state_bytes) / params, "params": params,
            "final_loss": run["final_loss"]}


def bench_steps(quick: bool, log, timeout: float, steps: int, warmup: int, only_batches=None,
                configs=None) -> list[dict]:
    out = []
    batches = [1, 4] if quick else BATCHES
    batches = only_batches or batches
    for b in batches:
        for c in configs or STEP_CONFIGS:
            row = {"config": c, "B": b, "T": 1024}
            t0 = time.time()
            row.update(steprun.run_worker([__file__, "--worker", c, "--batch", str(b), "--steps", str(steps),
                                           "--warmup", str(warmup)], timeout))
            row["wall_s"] = round(time.time() - t0, 1)
            log(json.dumps({k: v for k, v in row.items() if k not in ("step_ms_all", "error")})
                + (f"\n  error: {row['error'][-600:]}" if row.get("error") else ""))
            out.append(row)
    return out


# ----------------------------------------------------------------------------- report


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# FORGE benchmark — {env.get('gpu', '?')}, {env['date']}", "",
             f"torch {env['torch']}, Triton {env.get('triton')}; command: `{res['command']}`", ""]
    a = res.get("layer")
    if a:
        lines += ["## (a) one linear layer: fused dW + AdamW vs matmul + torch AdamW(fused)",
                  f"measured copy bandwidth {a['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; floor = max(bytes / bandwidth, "
                  "FLOPs / 790 TFLOP/s); bytes = X + dY once + W, m, v read and written", "",
                  "Times are do_bench medians (host launch overhead included); 'graph' columns replay a CUDA",
                  "graph (GPU time only); 'host µs' is the CPU time per call of back-to-back calls (Python +",
                  "launch). 'layer' is ForgeOptimizer's whole per-layer path (fused kernel + norm sum).", "",
                  "| N×K | T | torch ms | fused ms | split ms | floor ms | torch/fused | torch/best | best path "
                  "| torch graph ms | fused graph ms | torch/fused (graph) | layer ms | layer graph ms "
                  "| torch host µs | fused host µs | layer host µs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in a["rows"]:
            if "error" in r:
                lines.append(f"| {r['N']}×{r['K']} | {r['T']} | error: {r['error'][:80]} ||||||||||||||")
                continue
            lines.append(f"| {r['N']}×{r['K']} | {r['T']} | {r['torch_ms']:.3f} | {r['fused_ms']:.3f} | "
                         f"{r['split_ms']:.3f} | {r['floor_ms']:.3f} | {r['speedup_fused']:.2f}× | "
                         f"{r['speedup_dispatch']:.2f}× | {r['best_path']} | {_f(r.get('torch_graph_ms'))} | "
                         f"{_f(r.get('fused_graph_ms'))} | {_f(r.get('speedup_fused_graph'), '×')} | "
                         f"{_f(r.get('layer_ms'))} | {_f(r.get('layer_graph_ms'))} | {_u(r.get('torch_host_us'))} | "
                         f"{_u(r.get('fused_host_us'))} | {_u(r.get('layer_host_us'))} |")
        lines.append("")
        wsr = [r for r in a["rows"] if "ws_ms" in r]
        if wsr:
            lines += ["### The warp-specialized kernel (`forge/ws.py`, sm_90) against the split path", "",
                      "fp32 W / m / v, bf16 X / dY, as in the table above. 'ws' is the Gluon kernel alone, 'layer ws'",
                      "ForgeOptimizer's per-layer path with it (`attach(ws_tokens=...)`); ratios are torch's time over",
                      "each path's, from do_bench medians and from CUDA-graph replays (GPU time).", "",
                      "| N×K | T | torch ms | split ms | ws ms | layer ws ms | torch/split | torch/ws | torch/layer ws "
                      "| torch graph ms | split graph ms | ws graph ms | torch/split (graph) | torch/ws (graph) |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in wsr:
                lines.append(f"| {r['N']}×{r['K']} | {r['T']} | {r['torch_ms']:.3f} | {r['split_ms']:.3f} | "
                             f"{r['ws_ms']:.3f} | {_f(r.get('layer_ws_ms'))} | {r['speedup_split']:.2f}× | "
                             f"{r['speedup_ws']:.2f}× | {_f(r.get('speedup_layer_ws'), '×')} | "
                             f"{_f(r.get('torch_graph_ms'))} | {_f(r.get('split_graph_ms'))} | "
                             f"{_f(r.get('ws_graph_ms'))} | {_f(r.get('speedup_split_graph'), '×')} | "
                             f"{_f(r.get('speedup_ws_graph'), '×')} |")
            lines.append("")
        w16 = [r for r in a["rows"] if "ws16_ms" in r]
        if w16:
            lines += ["### bf16 dW (`grad_dtype=\"bf16\"`), the baseline's own dW precision", "",
                      "torch's dW here is the bf16 matmul's, cast to fp32. 'split16': the split path with a bf16 dW;",
                      "'ws16': the Gluon kernel handing its tile over in bf16 (`launch_ws(dw_bf16=True)`, the schedule",
                      "of `auto_config(dw_bf16=True)`). CUDA-graph replays (GPU time).", "",
                      "| N×K | T | torch graph ms | split16 graph ms | ws16 graph ms | torch/split16 | torch/ws16 |",
                      "|---|---|---|---|---|---|---|"]
            for r in w16:
                lines.append(f"| {r['N']}×{r['K']} | {r['T']} | {_f(r.get('torch_graph_ms'))} | "
                             f"{_f(r.get('split16_graph_ms'))} | {_f(r.get('ws16_graph_ms'))} | "
                             f"{_f(r.get('speedup_split16_graph'), '×')} | {_f(r.get('speedup_ws16_graph'), '×')} |")
            lines.append("")
        wf = [r for r in a["rows"] if "ws_fast_graph_ms" in r]
        if wf:
            lines += ["### The Gluon kernel with `fast_math` (approximate sqrt / division in AdamW)", "",
                      "'ws fast' / 'ws16 fast': 'ws' / 'ws16' with the rule's square root and divisions by the GPU's",
                      "approximate instructions (`launch_ws(approx=True)`, FORGE's `fast_math=True`); the exact ones",
                      "beside them. CUDA-graph replays (GPU time); ratios are torch's time over the path's.", "",
                      "| N×K | T | torch graph ms | ws | ws16 | ws fast | ws16 fast | torch/ws | torch/ws16 | torch/ws fast "
                      "| torch/ws16 fast |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in wf:
                lines.append(f"| {r['N']}×{r['K']} | {r['T']} | {_f(r.get('torch_graph_ms'))} | "
                             f"{_f(r.get('ws_graph_ms'))} | {_f(r.get('ws16_graph_ms'))} | "
                             f"{_f(r.get('ws_fast_graph_ms'))} | {_f(r.get('ws16_fast_graph_ms'))} | "
                             f"{_f(r.get('speedup_ws_graph'), '×')} | {_f(r.get('speedup_ws16_graph'), '×')} | "
                             f"{_f(r.get('speedup_ws_fast_graph'), '×')} | {_f(r.get('speedup_ws16_fast_graph'), '×')} |")
            lines.append("")
        prod = [r for r in a["rows"] if "torch_over_layer_bf16_int8_fused" in r]
        if prod:
            lines += ["### FORGE as recommended: bf16 W + stochastic rounding + int8 AdamW states (`--product`)", "",
                      "ForgeOptimizer's per-layer path (split = cuBLAS dW + update kernel, the default; fused = the",
                      "dW + update kernel). torch = matmul + AdamW(fused) with fp32 W/m/v (the table above); torch",
                      "bf16 = the same with bf16 W, dW and states. Floor: X + dY once, bf16 W and int8 states read",
                      "and written.", "",
                      "| N×K | T | torch ms | torch bf16 ms | FORGE split ms | FORGE fused ms | floor ms "
                      "| torch / split | torch / fused | torch bf16 / split | torch bf16 / fused |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in prod:
                lines.append(f"| {r['N']}×{r['K']} | {r['T']} | {r['torch_ms']:.3f} | {r['torch_bf16_ms']:.3f} | "
                             f"{r['layer_bf16_int8_ms']:.3f} | {r['layer_bf16_int8_fused_ms']:.3f} | "
                             f"{r['floor_bf16_int8_ms']:.3f} | {r['torch_over_layer_bf16_int8']:.2f}× | "
                             f"{r['torch_over_layer_bf16_int8_fused']:.2f}× | "
                             f"{r['torch_bf16_over_layer_bf16_int8']:.2f}× | "
                             f"{r['torch_bf16_over_layer_bf16_int8_fused']:.2f}× |")
            lines.append("")
    b = res.get("steps")
    if b:
        lines += ["## (b) whole training step, 1b preset, T = 1024", "",
                  "| config | B | step ms | peak GiB | held GiB | above held GiB | persistent B/param | warm-up s "
                  "| wall s | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in b:
            if r.get("status") != "ok":
                lines.append(f"| {r['config']} | {r['B']} | | | | | | | {r.get('wall_s', '')} | {r.get('status')} |")
                continue
            lines.append(f"| {r['config']} | {r['B']} | {r['step_ms']:.1f} | {_gb(r['peak_bytes'])} | "
                         f"{_gb(r['held_bytes'])} | {_gb(r['above_held_bytes'])} | "
                         f"{r['persistent_bytes_per_param']:.4f} | {r.get('warmup_s', 0):.1f} | {r.get('wall_s', '')} | ok |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, tokens and batch sizes")
    ap.add_argument("--part", choices=["a", "b", "all", "sass"], default="all")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per whole-step configuration")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", help="part (b) batch sizes (default 1 4 16; quick: 1 4)")
    ap.add_argument("--configs", nargs="*", choices=STEP_CONFIGS + EXTRA_CONFIGS,
                    help="part (b) configurations (default: the six of the issue)")
    ap.add_argument("--timeout-a", type=float, default=300.0, help="seconds for part (a)")
    ap.add_argument("--product", action="store_true",
                    help="part (a): also FORGE bf16 W + SR + int8 states (split and fused) and torch pure-bf16 AdamW")
    ap.add_argument("--tokens", type=int, nargs="*", help="part (a) token counts (default 512 1024 2048 4096 16384)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--layer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:  # a subprocess of part (b)
        steprun.print_result(steprun.guarded(lambda: step_worker(args.worker, args.batch, 1024, args.steps,
                                                                 args.warmup)))
        return 0

    if args.part == "sass":  # static, no GPU: the update kernel's SASS counted per element
        from parts import update_sass

        update_sass.run(Path(args.out))
        return 0

    import torch

    if args.layer_worker:  # part (a), in a subprocess
        os.environ.pop("TRITON_INTERPRET", None)
        try:
            r = bench_layer(args.quick, lambda m: print(m, flush=True), args.product, args.tokens)
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {e}", "rows": []}
            print(traceback.format_exc(), flush=True)
        print("RESULT " + json.dumps(r), flush=True)
        return 0

    if not torch.cuda.is_available():
        print("bench_forge: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _env()
    stem = harness.stem({"a": "layer", "b": "step"}.get(args.part, ""))

    def log(msg):
        print(msg, flush=True)

    res = {"env": env, "command": "PYTHONPATH=src python3 benchmarks/bench_forge.py " + " ".join(argv or sys.argv[1:])}
    t0 = time.time()
    if args.part in ("a", "all"):  # in its own process too (nothing of it stays on the GPU for part (b))
        env_a = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        try:
            sub = (["--quick"] if args.quick else []) + (["--product"] if args.product else [])
            sub += ["--tokens", *map(str, args.tokens)] if args.tokens else []
            r = subprocess.run([sys.executable, __file__, "--layer-worker"] + sub,
                               capture_output=True, text=True, timeout=args.timeout_a, env=env_a)
            for line in r.stdout.splitlines():
                if not line.startswith("RESULT "):
                    log(line)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if line:
                res["layer"] = json.loads(line[-1][7:])
            else:
                res["layer_error"] = (r.stderr or r.stdout)[-2000:]
                log(res["layer_error"])
        except subprocess.TimeoutExpired:
            res["layer_error"] = f"part (a): no result within {args.timeout_a}s"
            log(res["layer_error"])
        log(f"part (a) done in {time.time() - t0:.0f}s")
    if args.part in ("b", "all"):
        res["steps"] = bench_steps(args.quick, log, args.timeout, args.steps, args.warmup, args.batches, args.configs)
    res["wall_s"] = round(time.time() - t0, 1)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(res))
    log(markdown(res))
    log(f"wrote {out / (stem + '.json')} and .md in {res['wall_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
