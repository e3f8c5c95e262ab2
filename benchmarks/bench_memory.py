"""Memory and speed of a whole training step on one GPU, side by side over the ways to fit a model.

The ``memory`` topic: plain torch, torchtune's low-memory recipe, FORGE and ChunkFT.

    PYTHONPATH=src python3 benchmarks/bench_memory.py --presets 7b 8b --batches 1 2 4 --seqs 1024
        [--vocab 32000] [--configs ...] [--largest] [--steps 5 --warmup 2] [--timeout 300]
        [--device cuda] --out DIR [--name memory]

One step is forward, backward and the optimizer's step of leantrain's Llama at a preset's shape
(``1b``, ``7b`` = Llama-2-7B, ``8b`` = Llama-3-8B with its 128k vocabulary; ``--vocab`` sets the
vocabulary, e.g. the 8b shape with 32k), on random tokens from a fixed seed. Hyper-parameters for
all: lr 2e-5, betas (0.9, 0.95), weight decay 0, eps 1e-8. Each (configuration, B, T) runs in a
fresh process (``parts/steprun.py``: peaks do not mix; OOM, errors and timeouts are recorded and
the run goes on). Reported: status, median step seconds, tokens/s, the CUDA allocator's peak, the
bytes held between steps, weight and optimizer-state bytes (ChunkFT: on the device, and in host
memory apart), the saved activations of one forward (``leantrain.runtime.ledger``'s meter) and the
final loss. On CPU (``--device cpu``) the allocator peak is null. ``--largest``: per configuration,
B doubled from the largest listed until OOM or ``--largest-cap``; the largest that fits and its
tokens/s.

The configurations (``CONFIGS``; bf16 weights unless said):

- ``torch_bf16``: ``torch.optim.AdamW(fused=True)``, bf16 weights and states.
- ``torch_bf16_ckpt``: the same with activation checkpointing (``activation_checkpointing``).
- ``torch_fp32_master_autocast``: fp32 weights, fused AdamW, bf16 autocast (FORGE's baseline).
- ``torchtune_recipe``: torchtune's single-device low-memory recipe in plain torch: 8-bit AdamW
  (``parts/adamw8bit.py``: blockwise dynamic quantization, block 256) stepped in backward
  (``register_post_accumulate_grad_hook``, one optimizer a parameter, the gradient freed at once),
  activation checkpointing.
- ``forge_bf16_states``, ``forge_int8_states``, ``forge_int8_states_agoq``,
  ``forge_int8_states_agoq_ckpt``, ``forge_fp8_states``, ``forge_fp8_states_agoq``: FORGE
  (``lt.forge.attach``, stochastic rounding) with bf16, int8 or fp8 (e4m3) AdamW states, with
  AGoQ's saved activations, with checkpointing.
- ``torch_bf16_graph``, ``forge_bf16_states_graph``, ``forge_int8_states_graph``,
  ``forge_fp8_states_graph``, ``forge_int8_states_agoq_graph``, ``forge_fp8_states_agoq_graph``:
  the same steps with forward + backward replayed from a CUDA graph (``Config.graph``; the host's
  launch time leaves the step, as with ``--train.cuda-graph``).
- ``chunkft8``, ``chunkft8_ckpt``, ``chunkft32_ckpt``: ``lt.finetune.ChunkFT`` with 8 or 32 chunks.
- ``chunkft_fused_ckpt``, ``chunkft_fused_ckpt_agoq``: ChunkFT (8 chunks) with its update inside
  backward (``in_backward=True, state_dtype="bf16"``), checkpointing, and AGoQ.

Writes ``<date>_<hardware>_<name>.json`` and ``.md`` (one table per preset, vocabulary and T) into
``--out`` (``--name``, default ``memory``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from parts import steprun  # noqa: E402

HYPER = dict(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
GIB = 2**30


# ----------------------------------------------------------------------------- configurations


@dataclass
class Setup:
    """What a configuration adds to the model: ``finish`` closes a step after backward (the
    optimizer's step and zero_grad, or nothing when the update ran in backward); the bytes of its
    optimizer state on the model's device and in host memory."""

    finish: Callable[[], None]
    state_bytes: Callable[[], int]
    host_state_bytes: Callable[[], int] = lambda: 0
    capture_hooks: tuple = ()  # what runs inside backward on its own, for a CUDA-graph capture


@dataclass(frozen=True)
class Config:
    """A configuration: ``build(model)`` attaches its optimizer; the model's weights are fp32
    under bf16 autocast (``fp32_weights``) or bf16; ``checkpointing``: activation checkpointing;
    ``offload``: the checkpointed blocks' inputs in pinned host memory; ``graph``: forward and
    backward captured once as a CUDA graph after the warm-up and replayed
    (:class:`leantrain.runtime.capture.GraphedStep`, as ``--train.cuda-graph`` does; the
    optimizer's step after it runs eagerly): the host's per-kernel launch time leaves the step."""

    build: Callable
    fp32_weights: bool = False
    checkpointing: bool = False
    offload: bool = False  # with checkpointing: the blocks' inputs in host memory (model.activation_offload)
    graph: bool = False


def _bytes_of(tensors) -> int:
    from leantrain.runtime.ledger import count_bytes

    return count_bytes(tensors)


def _optimizer_state(opt) -> list:
    """Every tensor of ``opt``'s state, as ``MemoryLedger.measure`` counts it."""
    from leantrain.runtime.ledger import tensors_in

    tensors = list(tensors_in(list(opt.state.values())))
    return tensors + list(opt.extra_state_tensors()) if hasattr(opt, "extra_state_tensors") else tensors


def _closing(opt) -> Callable[[], None]:
    def finish():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return finish


def torch_adamw(model) -> Setup:
    """``torch.optim.AdamW(fused=True)`` over every parameter (states in the weights' dtype)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    return Setup(_closing(opt), lambda: _bytes_of(_optimizer_state(opt)))


def torchtune_recipe(model) -> Setup:
    """8-bit AdamW stepped in backward: one optimizer a parameter, run by the parameter's
    post-accumulate-grad hook, which then frees the gradient (torchtune's ``optimizer_in_bwd``)."""
    from parts.adamw8bit import AdamW8bit

    opts = {p: AdamW8bit([p], **HYPER) for p in model.parameters() if p.requires_grad}

    def hook(p):
        opts[p].step()
        p.grad = None

    for p in opts:
        p.register_post_accumulate_grad_hook(hook)
    return Setup(lambda: None, lambda: _bytes_of([t for o in opts.values() for t in o.state_tensors()]))


def forge(model, *, state_dtype: str, agoq: bool = False) -> Setup:
    """FORGE's AdamW fused into the linear layers' backward, bf16 weights with stochastic
    rounding, states in ``state_dtype``; ``agoq``: AGoQ's ~4-bit saved activations."""
    import leantrain as lt

    opt = lt.forge.attach(model, lt.optim.AdamW(**HYPER), state_dtype=state_dtype, stochastic_rounding=True)
    if agoq:
        lt.agoq.apply(model, lt.agoq.Policy())
    return Setup(_closing(opt), lambda: _bytes_of(_optimizer_state(opt)), capture_hooks=(opt.capture_hooks,))


def chunkft(model, *, num_chunks: int, agoq: bool = False, **chunkft_kw) -> Setup:
    """``lt.finetune.ChunkFT(model, "adamw", num_chunks=...)``; ``chunkft_kw`` go to ChunkFT."""
    import leantrain as lt

    opt = lt.finetune.ChunkFT(model, "adamw", num_chunks=num_chunks, **HYPER, **chunkft_kw)
    if agoq:
        lt.agoq.apply(model, lt.agoq.Policy())
    return Setup(_closing(opt), opt.device_state_bytes, opt.host_state_bytes)


def _bind(fn, **kw) -> Callable:
    return lambda model: fn(model, **kw)


CONFIGS: dict[str, Config] = {
    "torch_bf16": Config(torch_adamw),
    "torch_bf16_ckpt": Config(torch_adamw, checkpointing=True),
    "torch_fp32_master_autocast": Config(torch_adamw, fp32_weights=True),
    "torchtune_recipe": Config(torchtune_recipe, checkpointing=True),
    "forge_bf16_states": Config(_bind(forge, state_dtype="bf16")),
    "forge_int8_states": Config(_bind(forge, state_dtype="int8")),
    "forge_int8_states_agoq": Config(_bind(forge, state_dtype="int8", agoq=True)),
    "forge_int8_states_agoq_ckpt": Config(_bind(forge, state_dtype="int8", agoq=True), checkpointing=True),
    "forge_fp8_states": Config(_bind(forge, state_dtype="fp8")),
    "forge_fp8_states_agoq": Config(_bind(forge, state_dtype="fp8", agoq=True)),
    "torch_bf16_graph": Config(torch_adamw, graph=True),
    "forge_bf16_states_graph": Config(_bind(forge, state_dtype="bf16"), graph=True),
    "forge_int8_states_graph": Config(_bind(forge, state_dtype="int8"), graph=True),
    "forge_fp8_states_graph": Config(_bind(forge, state_dtype="fp8"), graph=True),
    "forge_int8_states_agoq_graph": Config(_bind(forge, state_dtype="int8", agoq=True), graph=True),
    "forge_fp8_states_agoq_graph": Config(_bind(forge, state_dtype="fp8", agoq=True), graph=True),
    "chunkft8": Config(_bind(chunkft, num_chunks=8)),
    "chunkft8_ckpt": Config(_bind(chunkft, num_chunks=8), checkpointing=True),
    "chunkft32_ckpt": Config(_bind(chunkft, num_chunks=32), checkpointing=True),
    "chunkft_fused_ckpt": Config(_bind(chunkft, num_chunks=8, in_backward=True, state_dtype="bf16"),
                                 checkpointing=True),
    "chunkft_fused64_ckpt": Config(_bind(chunkft, num_chunks=64, in_backward=True, state_dtype="bf16"),
                                   checkpointing=True),
    "chunkft_fused128_ckpt": Config(_bind(chunkft, num_chunks=128, in_backward=True, state_dtype="bf16"),
                                    checkpointing=True),
    "chunkft_fused64_offload": Config(_bind(chunkft, num_chunks=64, in_backward=True, state_dtype="bf16"),
                                      checkpointing=True, offload=True),
    "chunkft_fused128_offload": Config(_bind(chunkft, num_chunks=128, in_backward=True, state_dtype="bf16"),
                                       checkpointing=True, offload=True),
    "chunkft_fused_ckpt_agoq": Config(_bind(chunkft, num_chunks=8, agoq=True, in_backward=True,
                                            state_dtype="bf16"), checkpointing=True),
}


# ----------------------------------------------------------------------------- one configuration


def vocabulary(preset_name: str, vocab: int | None) -> int:
    """``vocab``, or the preset's own vocabulary."""
    from leantrain.config import preset

    return vocab or preset(preset_name).data.tokenizer_vocab


def step_worker(config: str, preset_name: str, vocab: int, batch: int, seq: int, steps: int, warmup: int,
                device: str, profile: bool = False) -> dict:
    """One (configuration, B, T): build, warm up, time ``steps`` steps (in its own process);
    ``profile``: two more steps under ``torch.profiler``, their kernels by device time."""
    import torch

    from leantrain.config import preset
    from leantrain.model import Llama
    from leantrain.runtime.ledger import SavedActivationMeter

    spec = CONFIGS[config]
    torch.manual_seed(0)
    cfg = preset(preset_name).model
    cfg.vocab_size, cfg.max_seq_len = vocab, max(cfg.max_seq_len, seq)
    cfg.activation_checkpointing, cfg.activation_offload = spec.checkpointing, spec.offload
    with torch.device(device):
        model = Llama(cfg)
    if not spec.fp32_weights:
        model = model.to(torch.bfloat16)
    setup = spec.build(model)
    dev = torch.device(device)
    tokens = torch.Generator(device=dev).manual_seed(0)

    graph = []  # spec.graph: the captured forward + backward, made after the warm-up

    def forward(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=spec.fp32_weights):
            return model(x, y)

    def one_step(meter=None):
        idx = torch.randint(0, vocab, (batch, seq + 1), device=dev, generator=tokens)
        if graph and meter is None:
            loss = graph[0](idx[:, :-1], idx[:, 1:])
        else:
            with meter if meter is not None else contextlib.nullcontext():
                loss = forward(idx[:, :-1], idx[:, 1:])
            loss.backward()
        setup.finish()
        return loss.detach()

    def capture():  # its memory pool counts in the peak
        from leantrain.runtime.capture import GraphedStep

        idx = torch.randint(0, vocab, (batch, seq + 1), device=dev, generator=tokens)
        graph.append(GraphedStep(forward, model.parameters(), idx[:, :-1], idx[:, 1:], hooks=setup.capture_hooks))
        for _ in range(2):  # (a capture records kernels without running them; replays run them)
            one_step()

    run = steprun.timed_steps(one_step, warmup=warmup, steps=steps, device=device,
                              after_warmup=capture if spec.graph else None)
    meter = SavedActivationMeter(model.parameters())  # one more step, after the measured ones, eager
    one_step(meter)
    kernels = profiled(one_step, device) if profile else None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step_s = run["step_s"]
    return {"status": "ok", "step_s": step_s, "tokens_per_s": batch * seq / step_s, "warmup_s": run["warmup_s"],
            "step_s_all": run["times"], "peak_bytes": run["peak_bytes"], "held_bytes": run["held_bytes"],
            "weight_bytes": weight_bytes, "state_bytes": setup.state_bytes(),
            "host_state_bytes": setup.host_state_bytes(), "saved_activation_bytes": meter.bytes,
            "params": sum(p.numel() for p in model.parameters()), "final_loss": run["final_loss"],
            **({"profile": kernels} if profile else {})}


def profiled(one_step: Callable, device: str, steps: int = 2, top: int = 30) -> dict:
    """``steps`` steps under ``torch.profiler``: the host's wall time a step, the device's busy
    time a step, kernel launches a step and the ``top`` operators by device time (the table)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            one_step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6 / steps if kernels else None
    table = events.table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=top)
    return {"wall_s": wall, "device_busy_s": busy, "kernels_per_step": len(kernels) / steps, "table": table,
            "host_calls": host_call_sites(one_step, activities, steps)}


def host_call_sites(one_step: Callable, activities, steps: int = 2, top: int = 25) -> list[dict]:
    """The operators called most often a step and where from: ``steps`` more steps profiled with
    the Python tracer (a separate pass: it slows the host, so the timed profile above runs without
    it), each operator called from Python grouped by its innermost leantrain / benchmark frames."""
    from collections import Counter

    from torch.profiler import profile

    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            one_step()
    sites: Counter = Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue  # (operators an operator calls count with their caller)
        frames = []
        while parent is not None and len(frames) < 5:
            if ".py(" in parent.name and ("leantrain" in parent.name or "benchmarks" in parent.name):
                frames.append(parent.name.split("src/")[-1])
            parent = parent.cpu_parent
        sites[(e.name, tuple(frames))] += 1
    return [{"op": op, "calls_per_step": n / steps, "stack": list(frames)}
            for (op, frames), n in sites.most_common(top)]


# ----------------------------------------------------------------------------- the sweep


def run_one(args, preset_name: str, vocab: int, config: str, batch: int, seq: int) -> dict:
    """One (configuration, B, T) in a fresh process: its row."""
    env = steprun.worker_env()
    if args.device == "cpu" and "TRITON_INTERPRET" in os.environ:  # Triton on CPU: interpreted, as asked
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    argv = [__file__, "--worker", config, "--presets", preset_name, "--vocab", str(vocab), "--batch", str(batch),
            "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    argv += ["--profile"] if args.profile else []
    t0 = time.time()
    row = {"preset": preset_name, "vocab": vocab, "config": config, "B": batch, "T": seq,
           **steprun.run_worker(argv, args.timeout, env)}
    row["wall_s"] = round(time.time() - t0, 1)
    if row.get("peak_bytes") is not None:
        row["peak_gib"] = round(row["peak_bytes"] / GIB, 3)
    brief = {k: row.get(k) for k in ("preset", "vocab", "config", "B", "T", "status", "step_s", "tokens_per_s",
                                      "peak_gib", "final_loss", "wall_s")}
    print(brief, flush=True)
    if row["status"] not in ("ok", "oom"):
        print("  " + str(row.get("error", ""))[-600:].replace("\n", "\n  "), flush=True)
    return row


def largest(args, preset_name: str, vocab: int, config: str, seq: int, rows: list[dict]) -> dict:
    """B doubled from the largest listed (if it fits) until it does not fit or passes the cap:
    the largest B that fits, its tokens/s and peak, and why the search stopped."""
    fits = [r for r in rows if r["status"] == "ok"]
    best = max(fits, key=lambda r: r["B"]) if fits else None
    stopped, tried = f"B = {rows[0]['B']}: {rows[0]['status'].split(':')[0]}", []
    if best is not None and best["B"] == max(args.batches):
        batch, stopped = 2 * best["B"], "cap"
        while batch <= args.largest_cap:
            row = run_one(args, preset_name, vocab, config, batch, seq)
            tried.append(row)
            if row["status"] != "ok":
                stopped = row["status"]
                break
            best, batch = row, 2 * batch
    elif best is not None:
        stopped = "a larger listed B does not fit"
    return {"preset": preset_name, "vocab": vocab, "config": config, "T": seq,
            "B": best and best["B"], "tokens_per_s": best and best["tokens_per_s"],
            "peak_bytes": best and best["peak_bytes"], "stopped": stopped, "runs": tried}


def sweep(args, save: Callable[[dict], None]) -> dict:
    """Every (preset, T, configuration, B) in order, and with ``--largest`` each configuration's
    search; ``save(result so far)`` after each configuration (a run cut short keeps what it did)."""
    res = {"hyper": HYPER, "steps": args.steps, "warmup": args.warmup, "device": args.device, "complete": False,
           "rows": [], "largest": []}
    for preset_name in args.presets:
        vocab = vocabulary(preset_name, args.vocab)
        for seq in args.seqs:
            for config in args.configs:
                mine = [run_one(args, preset_name, vocab, config, b, seq) for b in args.batches]
                res["rows"] += mine
                if args.largest:
                    res["largest"].append(largest(args, preset_name, vocab, config, seq, mine))
                save(res)
    res["complete"] = True
    return res


# ----------------------------------------------------------------------------- report


def _gib(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / GIB:.1f}"


def _cell(row: dict | None) -> str:
    """``peak GiB / s a step``, or the status of a run that did not finish."""
    if row is None:
        return ""
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    return f"{_gib(row.get('peak_bytes'))} / {row['step_s']:.3f}"


def _largest_cell(g: dict | None) -> str:
    if g is None or g["B"] is None:
        return "" if g is None else g["stopped"]
    return f"{g['B']} ({g['tokens_per_s']:.0f}, {_gib(g['peak_bytes'])}), {g['stopped']}"


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# Memory and speed of one training step — {env.get('gpu', env['hardware'])}, {env['date']}", "",
             f"torch {env.get('torch')}, Triton {env.get('triton')}; command: `{res['command']}`", "",
             f"Cells: allocator peak GiB / median seconds a step ({res['steps']} timed after {res['warmup']} "
             "warm-up); lr 2e-5, betas (0.9, 0.95), weight decay 0, eps 1e-8.", ""]
    if not res.get("complete", True):
        lines += ["**Incomplete**: the run stopped before its last configuration.", ""]
    keys = sorted({(r["preset"], r["vocab"], r["T"]) for r in res["rows"]}, key=lambda k: (k[0], k[1], k[2]))
    for preset_name, vocab, seq in keys:
        rows = [r for r in res["rows"] if (r["preset"], r["vocab"], r["T"]) == (preset_name, vocab, seq)]
        batches = sorted({r["B"] for r in rows})
        configs = list(dict.fromkeys(r["config"] for r in rows))
        big = {g["config"]: g for g in res["largest"] if (g["preset"], g["vocab"], g["T"]) == (preset_name, vocab, seq)}
        head = [f"B = {b}" for b in batches] + (["largest B (tokens/s, peak GiB)"] if big else [])
        lines += [f"## {preset_name}, vocabulary {vocab}, T = {seq}", "", "| config | " + " | ".join(head) + " |",
                  "|---" * (len(head) + 1) + "|"]
        for c in configs:
            cells = [_cell(next((r for r in rows if r["config"] == c and r["B"] == b), None)) for b in batches]
            if big:
                cells.append(_largest_cell(big.get(c)))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    failed = [r for r in res["rows"] + [t for g in res["largest"] for t in g["runs"]]
              if r["status"] not in ("ok", "oom")]
    if failed:
        lines += ["## Failures", ""]
        for r in failed:
            last = [x for x in str(r.get("error", "")).strip().splitlines() if x.strip()][-1:] or [""]
            lines.append(f"- {r['config']} ({r['preset']}, B = {r['B']}, T = {r['T']}): {r['status']}: {last[0][:200]}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["7b", "8b"], choices=["tiny", "small", "125m", "1b", "7b", "8b"])
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--largest", action="store_true", help="per configuration, the largest batch that fits")
    ap.add_argument("--largest-cap", type=int, default=64, help="the largest B --largest tries")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per (configuration, B, T)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results/memory")
    ap.add_argument("--profile", action="store_true", help="each row also profiled: device busy time, kernel "
                    "launches a step and the operators by device time")
    ap.add_argument("--name", default="memory", help="the result files' name: <date>_<hardware>_<name>.json / .md")
    ap.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one (configuration, B, T), in its own process
        steprun.print_result(steprun.guarded(lambda: step_worker(
            args.worker, args.presets[0], args.vocab, args.batch, args.seq, args.steps, args.warmup, args.device,
            args.profile)))
        return 0
    t0 = time.time()
    head = {"command": harness.command(), "env": harness.env()}

    def save(res: dict) -> Path:
        res = {**head, **res, "wall_s": round(time.time() - t0, 1)}
        return harness.write(args.out, args.name, res, markdown(res))

    path = save(sweep(args, save))
    print(path.with_suffix(".md").read_text())
    print(f"wrote {path} and .md in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
