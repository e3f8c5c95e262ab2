"""``leantrain finetune``: fine-tune a trained model on a generated task with MeZO, GRZO, ChunkFT
(back-propagation into one chunk of the parameters at a time) or back-propagation (``full``:
AdamW), and measure accuracy and memory.

    leantrain finetune --method grzo --task compare --from runs/default --steps 300 --out runs/ft

The methods are techniques (:mod:`leantrain.finetune.technique`, found through the registry of
:mod:`leantrain.technique`): ``chunkft`` owns the step, ``mezo`` / ``grzo`` replace forward and
backward by their zeroth-order step, ``full`` is plain AdamW. The run shares the trainer's
runtime: device and process group (:mod:`leantrain.runtime.distributed`), checkpoints, the
typed config tree (``[finetune]``, ``[optim]``, ``[train]``).

``--from`` is a run directory of ``leantrain train`` (its newest checkpoint) or one checkpoint
directory, with the run's ``tokenizer.json`` (the trainer writes it); without it the model of
``--preset`` (and ``--section.field value`` overrides) starts from random weights (smoke tests,
memory measurements).
Writes ``metrics.jsonl`` (a line per logged step), the fine-tuned weights as a checkpoint with
the run's config, the optimizer's state and ``tokenizer.json`` (so ``--from`` takes the output
directory too; ``--ckpt-every N`` saves one every N steps as well, and ``--resume`` continues a
run from its newest one, bit for bit), and
``summary.json``: accuracy and loss on an evaluation set before and after, seconds a step (the
mean over the steps, and the median step: the first steps pay one-time costs), the seconds taken
to build the optimizer (``setup_seconds``), and memory. Memory is counted: the weights, and
what the method holds on top of them at its peak (gradients and AdamW states for ``full``; for
the zeroth-order methods one noise block and GRZO's per-example signs, read from the tensors
each step made; for ChunkFT the active chunk's gradient rows and AdamW states on the device, the
other chunks' states, offloaded to host memory, apart as ``offloaded_bytes``). On CUDA also the allocator's peak over the steps, against the peak of plain
inference forwards of the same batches (``peak_vs_inference``).

Under ``torchrun`` (``--method mezo|grzo``; gloo on CPU, NCCL on CUDA) each rank takes
``--batch-size`` examples of a global batch of ``world · batch-size``; the ranks keep identical
weights and exchange only their losses (:mod:`leantrain.finetune.zo`), rank 0 writes the files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from leantrain import config as config_mod
from leantrain import data
from leantrain.config import ConfigError
from leantrain.finetune import tasks
from leantrain.model import Llama
from leantrain.runtime import checkpoint, collectives, distributed
from leantrain.runtime.ledger import count_bytes, tensors_in
from leantrain.technique import Run
from leantrain.train import rundir, techniques

METHODS = ("mezo", "grzo", "chunkft", "full")
DEFAULT_LR = {"mezo": 3e-4, "grzo": 1e-5, "chunkft": 1e-4, "full": 1e-4}  # (tiny preset, compare task: finetune/README.md)


def load_model(source: str | None, preset: str, device, overrides: dict | None = None
               ) -> tuple[config_mod.Config, Llama, str, Path | None]:
    """(config, model with the checkpoint's weights, where they came from, the run's
    ``tokenizer.json`` if it has one)."""
    if source is None:
        cfg = config_mod.build(preset, overrides=overrides)
        torch.manual_seed(cfg.train.seed)
        return cfg, None, f"random weights of the {preset} preset", None
    if overrides:
        raise ConfigError("finetune: config overrides apply to --preset only; a checkpoint brings its own config")
    ckpt = checkpoint.resolve(source)
    if ckpt is None:
        raise ConfigError(f"--from {source}: neither a checkpoint directory nor a run directory with checkpoints")
    model_state, meta = checkpoint.load_model_state(ckpt)
    if "config" not in meta:
        raise ConfigError(f"checkpoint {ckpt} has no config in its meta.json")
    cfg = config_mod.from_dict(meta["config"])
    model = Llama(cfg.model)
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):  # (a tied head is saved once)
        raise ConfigError(f"checkpoint {ckpt} does not match its config: missing {missing}, unexpected {unexpected}")
    tok = ckpt.parent.parent / "tokenizer.json"
    return cfg, model.to(device), str(ckpt), tok if tok.exists() else None


def _step(tech, opt, model, b: tasks.Batch, params: list) -> tuple[float, int]:
    """One step on batch ``b``: (its loss, the bytes the method held beyond the weights at its peak:
    counted tensors)."""
    if tech is not None and tech.zeroth_order:
        loss = tech.zo_step(opt, lambda: tasks.losses(model, b))
        return loss, tech.held_bytes(opt)
    model.train()  # back-propagation: full AdamW, or a technique that owns the step (ChunkFT)
    opt.zero_grad(set_to_none=True)
    lv = tasks.losses(model, b).mean()
    lv.backward()
    if tech is not None:
        held = tech.held_bytes(opt)
        opt.step()
    else:
        grads = count_bytes(p.grad for p in params if p.grad is not None)
        opt.step()
        held = max(grads, count_bytes(p.grad for p in params if p.grad is not None)
                   + count_bytes(tensors_in(dict(opt.state))))
    model.eval()
    return float(lv.detach()), held


_FLAGS = {"method": "--method", "task": "--task", "seed": "--train.seed", "batch_size": "--data.batch-size",
          "world_size": "torchrun --nproc-per-node", "num_chunks": "--finetune.num-chunks",
          "interval": "--finetune.interval"}


def _resume_state(out_dir: Path, rank: int, dev, mine: dict, log) -> tuple[Path, dict, dict]:
    """(the newest intact checkpoint, this rank's state in it, the run's ``finetune`` meta), after
    checking that the checkpoint was made with the run options ``mine``: a difference is refused
    with one sentence naming each field and the flag that matches, before anything is written."""
    ckpt, warnings = checkpoint.latest_intact(out_dir)
    for w in warnings:
        log(f"warning: {w}")
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint in {out_dir / 'checkpoints'} (the run saves one every "
                          "--train.ckpt-every steps and at its end)")
    try:
        rank_state, meta = checkpoint.load_rank_state(ckpt, rank=rank, device=dev)  # (load_model reads the weights)
    except FileNotFoundError as e:
        raise ConfigError(f"--resume: {e}") from None
    ft = meta.get("finetune", {})
    differ = [k for k in mine if k in ft and ft[k] != mine[k]]
    if differ:
        raise ConfigError(f"--resume: the checkpoint {ckpt} was made with "
                          + ", ".join(f"{k} {ft[k]} (this run: {mine[k]}; pass {_FLAGS[k]} {ft[k]})" for k in differ)
                          + "; nothing was changed")
    return ckpt, rank_state, ft


def _inference_peak(model, batches, dev) -> int:
    """The allocator's peak of plain inference forwards of ``batches`` (CUDA), before the method
    holds anything; the peak statistics are reset after."""
    peak = 0
    for b in batches:
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            tasks.losses(model, b)
        peak = max(peak, torch.cuda.max_memory_allocated(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    return peak


def finetune(*, method: str, task: str, out: str, source: str | None = None, preset: str = "tiny",
             steps: int = 300, lr: float | None = None, eps: float = 1e-3, weight_decay: float = 0.0,
             batch_size: int = 16, eval_examples: int = 512, seed: int = 0, log_every: int = 10,
             device: str | None = None, overrides: dict | None = None, num_chunks: int = 4, interval: int = 1,
             ckpt_every: int = 0, resume: bool = False, log=print) -> dict:
    """One fine-tuning run, top to bottom: checks, the resume state, the model and tokenizer, the
    evaluation before, the method (a registered technique, or AdamW), the steps, the evaluation
    after, the checkpoint and ``summary.json``. It stays one function (about 125 lines) because
    those phases share a dozen local values (the batches, the method, the timings) that helpers
    would only pass around."""
    if method not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if task not in tasks.TASKS:
        raise ConfigError(f"--task must be one of {', '.join(tasks.TASKS)}, got {task!r}")
    if steps < 1 or batch_size < 2:
        raise ConfigError("finetune needs --steps >= 1 and --batch-size >= 2 (GRZO normalizes over the batch)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and method == "full":
        raise ConfigError("finetune --method full runs in one process; under torchrun use mezo or grzo "
                          "(or leantrain train for data-parallel back-propagation)")
    dev, rank, world = distributed.setup(device or "auto")
    if rank:
        log = lambda *a: None  # noqa: E731 (rank 0 reports)
    out_dir = Path(out)
    resumed = None  # (this rank's optimizer state and step, the run's first evaluation and origin)
    if resume:
        mine = {"method": method, "task": task, "seed": seed, "batch_size": batch_size, "world_size": world}
        if method == "chunkft":
            mine.update(num_chunks=num_chunks, interval=interval)
        ckpt, rank_state, ft = _resume_state(out_dir, rank, dev, mine, log)
        resumed = (rank_state, ft)
        source, overrides = str(ckpt), None  # (its weights, config and the run's tokenizer.json)
    cfg, model, origin, tok_path = load_model(source, preset, dev, overrides)
    if resumed is not None:
        origin = resumed[1]["from"]
    if tok_path is not None:
        tok = data.Tokenizer.load(tok_path)
    else:  # a run without its tokenizer.json (older, or random weights): the corpus's, trained or cached
        log("no tokenizer.json in the run directory: using the configured corpus's tokenizer")
        tok = data.load(cfg.data, log=log).tokenizer
        if tok is None:
            raise ConfigError("finetune needs a tokenizer: the run was trained on pre-tokenized .bin data")
    if model is None:  # random weights: the vocabulary is the tokenizer's
        cfg.model.vocab_size = tok.vocab_size
        model = Llama(cfg.model).to(dev)
    model.float()  # (MeZO restores weights by subtraction: fp32; the others train fp32 weights too here)
    pad = tok.eot_id
    evalb = tasks.encode(tasks.examples(task, eval_examples, seed=1_000_003 + seed), tok, pad).to(dev)
    model.eval()
    if resumed is None:
        acc0, loss0 = tasks.accuracy(model, evalb)
    else:  # (the run's first evaluation, from the checkpoint)
        acc0, loss0 = resumed[1]["accuracy_before"], resumed[1]["eval_loss_before"]
    lr = DEFAULT_LR[method] if lr is None else lr
    log(f"finetune {method} on {task} from {origin}: {cfg.model.n_layers} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; before: accuracy {acc0:.3f}, "
        f"loss {loss0:.4f}")

    trainset = tasks.examples(task, steps * batch_size * world, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        tok.save(out_dir / "tokenizer.json")  # (a run directory like the trainer's: --from and --resume take it)

    def batch_of(step: int) -> tasks.Batch:  # this rank's part of the step's global batch
        first = ((step - 1) * world + rank) * batch_size
        return tasks.encode(trainset[first:first + batch_size], tok, pad).to(dev)

    cuda = dev.type == "cuda"
    infer_peak = _inference_peak(model, (batch_of(i + 1) for i in range(min(steps, 4))), dev) if cuda else 0
    params = [p for p in model.parameters() if p.requires_grad]
    t_setup = time.perf_counter()
    cfg.finetune.method, cfg.finetune.eps = method, eps
    cfg.finetune.num_chunks, cfg.finetune.interval = num_chunks, interval
    cfg.optim.lr, cfg.optim.weight_decay, cfg.train.seed = lr, weight_decay, seed
    classes = techniques.wanted(cfg)
    techniques.check(classes, cfg, device=dev, world=world)
    run = Run(cfg, model, dev, rank, world, log=log)
    tech = next((t for t in techniques.build(classes, run) if t.owns_step), None)
    opt = tech.optimizer(run, None) if tech is not None else torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    setup = time.perf_counter() - t_setup  # (ChunkFT page-locks its host block here)
    start = 0
    if resumed is not None:
        opt.load_state_dict(resumed[0]["optimizer"])
        start = int(resumed[0]["step"])
        if start >= steps:
            raise ConfigError(f"--resume: the checkpoint is at step {start}, --steps is {steps}: nothing to do")
        log(f"resumed at step {start} from {out_dir / 'checkpoints'}")
    meta = {"config": cfg.to_dict(), "finetune": {
        "method": method, "task": task, "from": origin, "lr": lr, "seed": seed, "batch_size": batch_size,
        "world_size": world, "num_chunks": num_chunks, "interval": interval, "accuracy_before": acc0, "eval_loss_before": loss0}}

    def save(step: int) -> Path:
        return checkpoint.save(out_dir, step, model.state_dict(), {"optimizer": opt.state_dict(), "step": step}, meta,
                               rank=rank, world=world, barrier=collectives.barrier)
    weights = count_bytes(model.parameters())
    extra, t0, times = 0, time.perf_counter(), []
    metrics = out_dir / "metrics.jsonl"
    if resumed is not None and rank == 0:  # drop lines past the checkpoint (logged, then lost)
        rundir.truncate_metrics(metrics, start)
    with open(metrics, "a" if resumed is not None else "w") if rank == 0 else open(os.devnull, "w") as mf:
        for step in range(start + 1, steps + 1):
            t = time.perf_counter()
            loss, held = _step(tech, opt, model, batch_of(step), params)  # (ends on a loss read back)
            times.append(time.perf_counter() - t)
            extra = max(extra, held)
            if step % log_every == 0 or step == steps:
                rec = {"step": step, "loss": loss, "seconds": time.perf_counter() - t0}
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                log(f"step {step}/{steps} loss {loss:.4f}")
            if ckpt_every and step % ckpt_every == 0 and step < steps:
                save(step)
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) if cuda else 0  # (the steps only: read before the evaluation)
    model.eval()
    if hasattr(opt, "detach"):  # (ChunkFT: the model's own forwards again)
        opt.detach()
    acc1, loss1 = tasks.accuracy(model, evalb)
    ckpt = save(steps)
    if rank:
        return {}
    summary = {
        "method": method, "task": task, "world_size": world, "from": origin,
        "tokenizer": str(tok_path) if tok_path else "the corpus's",
        "steps": steps, "batch_size": batch_size, "lr": lr, "eps": eps, "seed": seed, "device": str(dev),
        "accuracy_before": acc0, "accuracy_after": acc1, "eval_loss_before": loss0, "eval_loss_after": loss1,
        "checkpoint": str(ckpt), "resumed_from_step": start, "seconds_per_step": secs / (steps - start),
        "median_step_seconds": sorted(times)[len(times) // 2], "setup_seconds": setup, "weights_bytes": weights, "method_bytes": extra,
        "memory_vs_weights": (weights + extra) / weights,
    }
    if tech is not None:
        summary.update(tech.summary(opt))
    if cuda:
        summary.update(peak_memory_bytes=peak, inference_peak_bytes=infer_peak, peak_vs_inference=peak / infer_peak,
                       peak_above_weights_bytes=peak - weights)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"after: accuracy {acc1:.3f} (before {acc0:.3f}), loss {loss1:.4f}; {secs / (steps - start):.3f} s a step; "
        f"weights + method {summary['memory_vs_weights']:.3f}x the weights; summary in {out_dir / 'summary.json'}")
    return summary


__all__ = ["finetune", "load_model", "METHODS"]
