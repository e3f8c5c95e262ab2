"""The training loop: one code path for CPU, one GPU and ``torchrun``.

``Trainer(cfg, out_dir).fit()`` builds the data, the model and the techniques the config asks
for (:mod:`leantrain.technique`: each registered technique says when it is wanted, checks the
combination, and joins the run through its hooks), then the optimizer: the one of the technique
that owns the step, else the reference :class:`leantrain.optim.Optimizer` (``--baseline``:
``torch.optim.AdamW``), wrapped in DDP under torchrun unless a technique reduces the gradients
itself.

It logs ``metrics.jsonl``, writes ``config.json``, ``summary.json``, a loss
plot and atomic checkpoints, and ``resume=True`` continues bit-identically.
The host does not wait for a step's backward: its loss (and grad norm, a technique's non-finite
count) stay on the device, and the rows are read together once the step after a log step
(``train.log_every``) has been issued (before an evaluation or a checkpoint at once): no sync on
the steps between. A non-finite loss stops the run when its row is written
(``train.on_nonfinite=stop``), or is checked before its update and skipped (``skip``: a sync a
step).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from leantrain import data as data_mod
from leantrain.config import Config, ConfigError
from leantrain.data import tasks
from leantrain.model import Llama
from leantrain.model.hf_export import write_tokenizer
from leantrain.model.hf_import import HFTokenizer
from leantrain.optim import Optimizer, make_rule
from leantrain.runtime import checkpoint, collectives, distributed
from leantrain.runtime.ddp_hooks import counted_allreduce_hook
from leantrain.runtime.ledger import COMM, MemoryLedger, SavedActivationMeter
from leantrain.technique import Run
from leantrain.train import budget, evalset, init_from, rundir, techniques
from leantrain.train.progress import Progress, plot_losses
from leantrain.train.rows import StepRows, StopSignals, val_row
from leantrain.train.trackers import open_trackers


class NonFiniteLoss(RuntimeError):
    pass


class Interrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run after a step; its checkpoint, summary and plot are written."""


def log0(*args) -> None:
    if collectives.rank() == 0:
        print(*args, flush=True)


def setup_distributed(cfg: Config) -> tuple[torch.device, int, int]:
    """Device and process group from the environment (torchrun sets RANK/WORLD_SIZE)."""
    return distributed.setup(cfg.train.device, cfg.dist.timeout_s)


def lr_lambda(cfg: Config):
    o, steps = cfg.optim, max(cfg.train.steps, 1)

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if o.schedule == "cosine" else 1.0 - frac
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape

    return f


def rule_from_config(cfg: Config):
    o = cfg.optim
    kw = {"lr": o.lr, "weight_decay": o.weight_decay}
    if o.name in ("adamw", "adams"):
        kw.update(betas=o.betas, eps=o.eps)
    elif o.name == "lion":
        kw.update(betas=o.betas)
    else:
        kw.update(momentum=o.momentum, nesterov=o.nesterov)
    return make_rule(o.name, **kw)


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path, *, baseline: bool = False, resume: bool = False,
                 overwrite: bool = False):
        self.cfg, self.out, self.baseline, self.resume = cfg, Path(out_dir), baseline, resume
        self.device, self.rank, self.world = setup_distributed(cfg)
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        rundir.prepare(self.out, resume=resume, overwrite=overwrite and self.rank == 0)
        # train.init_from: the model section, tokenizer and weights of a pretrained model
        self.pretrained = init_from.open_source(cfg.train.init_from, log=log0) if cfg.train.init_from else None
        if self.pretrained is not None:
            init_from.apply_model(cfg, self.pretrained)
        if cfg.train.memory_budget and not baseline:  # (picks techniques: before they are chosen)
            budget.fit(cfg, log=log0)
        self.technique_classes = [c for c in techniques.wanted(cfg) if c.baseline_ok or not baseline]
        self._check_combination()
        self.resume_from = self._check_resume() if resume else None  # (before anything is written)
        self.data = self._load_data()
        if self.pretrained is None:
            cfg.model.vocab_size = self.data.vocab_size
        else:
            init_from.check_vocabulary(self.pretrained, self.data.vocab_size)
        if cfg.train.cuda_graph and getattr(self.data, "packed", False):
            raise ConfigError("train.cuda_graph captures plain token batches; pass --data.pack false with "
                              "instruct / chat data")
        self._keep_tokenizer()
        torch.manual_seed(cfg.train.seed)
        self.model = Llama(cfg.model)
        if self.pretrained is not None and self.resume_from is None:
            self.model.load_state_dict(self.pretrained.weights())
            log0(f"weights from {self.pretrained.describe}")
        if cfg.train.weights == "bf16":
            self.model.to(torch.bfloat16)
        self.model.to(self.device)
        self.step = 0
        self.ddp = None
        self.graph = None  # train.cuda_graph: the captured forward + backward (made at the first unmeasured step)
        self.run = Run(cfg, self.model, self.device, self.rank, self.world, log=log0, param_groups=self._groups())
        self.techniques = techniques.build(self.technique_classes, self.run)
        self.zo = next((t for t in self.techniques if t.zeroth_order), None)  # (its step replaces backward)
        self.opt = self._build_optimizer()
        if cfg.train.compile:  # (after the techniques attached their hooks and kernels)
            self.model.compile_blocks(cfg.train.compile_backend)
        # a technique's own checkpoints (state sharded across ranks), else checkpoint.save / load
        self.checkpointer = next((k for k in (t.checkpointer() for t in self.techniques) if k is not None), None)
        self.evalset = evalset.for_run(cfg, self.data, rank=self.rank, world=self.world, device=self.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        if self.resume_from is not None:
            self._load(self.resume_from)

    # ------------------------------------------------------------ composition

    def _check_resume(self) -> Path | None:
        """The checkpoint ``--resume`` continues from, after checking that it was made by this run's
        config (``rundir.RESUMABLE`` fields may differ); refused with one sentence naming every
        difference and the flag that matches, before anything in the run directory is written."""
        path, warnings = checkpoint.latest_intact(self.out)
        for w in warnings:
            log0(f"warning: {w}")
        if path is None:
            if warnings:
                raise ConfigError(f"--resume: no intact checkpoint in {self.out / 'checkpoints'}; "
                                  "pass --overwrite to start the run again")
            log0(f"--resume: no checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return None
        meta = checkpoint.read_meta(path)
        diffs = rundir.resume_mismatch(meta.get("config", {}), self.cfg.to_dict(), world=self.world,
                                       saved_world=meta.get("world_size", 1), reshard=checkpoint.reshardable(meta))
        if meta.get("baseline", False) != self.baseline:
            diffs.append(f"recipe {'--baseline' if meta.get('baseline') else 'not --baseline'} (pass "
                         f"{'--baseline' if meta.get('baseline') else 'no --baseline'})")
        if diffs:
            raise ConfigError(f"--resume: checkpoint {path} was made with " + "; ".join(diffs)
                              + ". Nothing in the run directory was changed.")
        return path

    def _load_data(self):
        """The configured data, encoded with the pretrained model's tokenizer when there is one; a
        generated task (``finetune.task``) with that tokenizer, else the embedded corpus's."""
        c = self.cfg
        tok = self.pretrained.tokenizer if self.pretrained is not None else None
        if c.finetune.task == "none":
            return data_mod.load(c.data, log=log0, tokenizer=tok)
        if tok is None:
            tok = data_mod.load(c.data, log=log0).tokenizer
        return tasks.task_data(c.finetune.task, tok, n_train=tasks.TRAIN_EXAMPLES, seq_len=c.data.seq_len,
                               seed=c.train.seed, grad_accum=c.data.grad_accum)

    def _keep_tokenizer(self) -> None:
        """The run's copy of its tokenizer (``--from RUN`` and ``export`` read it): ``tokenizer.json``,
        with ``tokenizer_config.json`` for a Hugging Face model's tokenizer; a resumed run's data must
        tokenize as the checkpoint's did."""
        tok = self.data.tokenizer
        if tok is None:
            return
        saved = self.out / "tokenizer.json"
        if self.resume_from is not None and saved.exists():
            old, probe = data_mod.Tokenizer.load(saved), "def f(x):\n    return x + 1  # tokenizer probe\n"
            if old.vocab_size != tok.vocab_size or old.encode(probe) != tok.encode(probe):
                raise ConfigError(f"--resume: the data's tokenizer differs from {saved} (another corpus or "
                                  "data.tokenizer_vocab); nothing in the run directory was changed")
            return
        if self.rank == 0:
            if isinstance(tok, HFTokenizer):  # (a model's own: its special tokens and chat template too)
                write_tokenizer(tok, self.out, self.cfg.model.max_seq_len)
            else:
                tok.save(saved)

    def _check_combination(self) -> None:
        c = self.cfg
        asked = [cls.name for cls in techniques.wanted(c) if not cls.baseline_ok]
        if self.baseline and asked:
            raise ConfigError(f"--baseline is plain PyTorch AdamW: do not combine it with {', '.join(asked)}")
        techniques.check(self.technique_classes, c, device=self.device, world=self.world)
        if c.model.activation_offload and (self.world > 1 or c.dist.mode == "fsdp"):
            raise ConfigError("model.activation_offload runs in one process (its recompute back-propagates "
                              "through the block on its own, which DDP's and FSDP's gradient hooks do not "
                              "expect); under torchrun use model.activation_checkpointing alone")
        if c.train.compile and c.train.cuda_graph:
            raise ConfigError("train.compile and train.cuda_graph both change how the step runs; choose one")
        if c.train.cuda_graph:
            why = [w for bad, w in (
                (self.device.type != "cuda", "a CUDA device"),
                (self.world > 1, "one process (DDP's reducer is not captured)"),
                (c.data.grad_accum > 1, "data.grad_accum 1 (a replay overwrites the gradients)"),
                (c.dist.mode != "ddp", "dist.mode ddp")) if bad]
            if why:
                raise ConfigError("train.cuda_graph needs " + "; ".join(why))

    def _no_decay_groups(self) -> list[dict]:
        """``optim.decay_1d`` false: the 1-D parameters (norm weights, biases) in a group without
        weight decay (the others keep ``optim.weight_decay``); true: none."""
        if self.cfg.optim.decay_1d:
            return []
        flat = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        return [{"params": flat, "weight_decay": 0.0}] if flat else []

    def _groups(self) -> list:
        """Every trainable parameter as torch optimizers take them: the ``_no_decay_groups``, the rest first."""
        extra = self._no_decay_groups()
        if not extra:
            return list(self.model.parameters())
        apart = {id(p) for g in extra for p in g["params"]}
        return [{"params": [p for p in self.model.parameters() if id(p) not in apart]}] + extra

    def _build_optimizer(self):
        c = self.cfg
        if self.baseline and not any(t.owns_step for t in self.techniques):  # (FSDP's own: torch AdamW too)
            self._wrap_ddp(None)
            o = c.optim
            return torch.optim.AdamW(self._groups(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     fused=self.device.type == "cuda")
        rule = rule_from_config(c)
        owner_class = techniques.step_owner(self.technique_classes)
        owner = next((t for t in self.techniques if type(t) is owner_class), None)
        if not any(t.reduces_gradients for t in self.techniques):
            hooks = [h for h in (t.ddp_comm_hook() for t in self.techniques) if h is not None]
            self._wrap_ddp(hooks[0] if hooks else None)
        if owner is not None:
            return owner.optimizer(self.run, rule)
        return Optimizer(self._groups(), rule, stochastic_rounding=c.train.weights == "bf16", seed=c.train.seed,
                         backend=c.optim.backend)

    def _wrap_ddp(self, comm_hook) -> None:
        """DDP under torchrun, with a technique's comm hook (``(state, hook)``) or the counted all-reduce."""
        if self.world == 1:
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.ddp.register_comm_hook(*(comm_hook or (None, counted_allreduce_hook)))

    @property
    def forward_module(self):
        return self.ddp if self.ddp is not None else self.model

    def _autocast(self):
        if self.cfg.train.dtype == "bf16" and self.cfg.train.weights == "fp32":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ one step

    def train_step(self, measure: bool = False) -> dict:
        if self.zo is not None:
            return self._zo_step(measure)
        c = self.cfg
        d = c.data
        meter = SavedActivationMeter(self.model.parameters()) if measure else None
        total = None  # the loss, on the device: read when the step is logged (fit), not here
        for micro in range(d.grad_accum):
            x, y = self.data.batch("train", d.seq_len, d.batch_size, seed=c.train.seed, step=self.step, micro=micro,
                                   rank=self.rank, world=self.world, device=self.device)
            sync = contextlib.nullcontext()
            if micro < d.grad_accum - 1:  # no gradient traffic until the last micro-batch
                if self.ddp is not None:
                    sync = self.ddp.no_sync()
                elif hasattr(self.opt, "no_sync"):
                    sync = self.opt.no_sync()
            # the meter is entered first: saved-tensor hooks nest, and the innermost (a technique's,
            # entered by the model's forward) sees each tensor and reports what it keeps to the meter
            for t in self.techniques:
                t.before_forward()
            # A non-finite loss: with train.on_nonfinite=skip the step is checked here (a sync: the
            # update must not happen); with stop (the default) fit() finds it when it logs the step,
            # without a sync per step, and stops before any later checkpoint is written.
            skip = c.train.on_nonfinite == "skip"
            if c.train.cuda_graph and meter is None:  # (the measured step runs eagerly: the meter sees its saves)
                loss = self._graph_step(x, y)
                if skip and not torch.isfinite(loss).item():
                    self._skip(loss)
                    return {"loss": float("nan"), "skipped": True, "lr": self.sched.get_last_lr()[0]}
            else:
                with sync, meter if (meter is not None and micro == 0) else contextlib.nullcontext():
                    with self._autocast():
                        loss = self.forward_module(x, y) / d.grad_accum
                    if skip and not torch.isfinite(loss.detach()).item():
                        self._skip(loss)
                        return {"loss": float("nan"), "skipped": True, "lr": self.sched.get_last_lr()[0]}
                    loss.backward()
            for t in self.techniques:
                t.after_micro_batch()
            lv = loss.detach().float()
            total = lv if total is None else total + lv
        for t in self.techniques:
            t.after_backward()
        if self.world > 1:  # log the global-batch loss (a 4-byte control message, not counted as traffic)
            t = total.reshape(1).clone()
            dist.all_reduce(t)
            total = t[0] / self.world
        info = {"loss": total, "lr": self.sched.get_last_lr()[0]}  # (the lr this step used)
        if c.optim.grad_clip > 0 and not any(t.clips_gradients() for t in self.techniques):
            info["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.optim.grad_clip)
        if measure:
            buffers = [b for t in self.techniques for b in t.grad_buffers()]
            self.last_memory = MemoryLedger.measure(self.model, self.opt, activations=meter.bytes, grad_buffers=buffers)
        self.opt.step()
        if measure:  # optimizer state may be created lazily by the first step: count it after
            self.last_memory.optimizer_states = MemoryLedger.measure(self.model, self.opt).optimizer_states
        for t in self.techniques:
            info.update(t.step_metrics(self.opt))
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        COMM.step()
        return info

    def _zo_step(self, measure: bool) -> dict:
        """A zeroth-order step (MeZO, GRZO): the technique scores this step's batch at perturbed
        weights, forwards only, and updates; the loss it returns is the global batch's. A
        non-finite loss leaves the weights as they were (the methods skip such an update)."""
        c = self.cfg
        x, y = self.data.batch("train", c.data.seq_len, c.data.batch_size, seed=c.train.seed, step=self.step,
                               rank=self.rank, world=self.world, device=self.device)
        for t in self.techniques:
            t.before_forward()

        def losses():  # (one per example: GRZO normalizes their differences over the batch)
            with self._autocast():
                return self.model(x, y, reduction="none")

        info = {"lr": self.sched.get_last_lr()[0]}
        info["loss"] = loss = float(self.zo.zo_step(self.opt, losses))
        if not math.isfinite(loss) and c.train.on_nonfinite == "skip":
            info["skipped"] = True
            log0(f"step {self.step + 1}: non-finite loss ({loss}); update skipped (train.on_nonfinite=skip)")
        if measure:
            self.last_memory = MemoryLedger.measure(self.model, self.opt)
        for t in self.techniques:
            info.update(t.step_metrics(self.opt))
        self.sched.step()
        COMM.step()
        return info

    def _graph_step(self, x, y):
        """Forward + backward replayed from the CUDA graph (captured at the first call); the
        loss is copied out of the graph's tensor, which the next replay overwrites."""
        if self.graph is None:
            from leantrain.runtime.capture import GraphedStep

            def fwd(x, y):
                with self._autocast():
                    return self.model(x, y)

            self.graph = GraphedStep(fwd, self.model.parameters(), x, y, hooks=self._capture_hooks())
        return self.graph(x, y).clone()

    def _capture_hooks(self) -> list:
        return [h for t in self.techniques for h in t.capture_hooks(self.opt)]

    def _skip(self, loss) -> None:
        self.opt.zero_grad(set_to_none=True)
        log0(f"step {self.step + 1}: non-finite loss ({loss.item()}); update skipped (train.on_nonfinite=skip)")

    def _stop(self, step: int, loss: float) -> NonFiniteLoss:
        last = checkpoint.latest(self.out)
        kept = (f"The last good checkpoint, {last}, is kept (--resume continues from it)." if last is not None
                else "No checkpoint was written before it.")
        return NonFiniteLoss(f"step {step}: the loss is {loss}; training stopped. {kept} Lower optim.lr, or pass "
                             "--train.on-nonfinite skip to skip such steps.")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The evaluation's figures (:mod:`leantrain.train.evalset`): ``loss``, and ``accuracy`` for
        multiple-choice data and generated tasks."""
        self.model.eval()
        with self._autocast():
            out = self.evalset.score(self.model)
        self.model.train()
        return out

    # ------------------------------------------------------------ checkpoints

    def _run_state(self) -> dict:
        """What a checkpoint keeps beside the weights and the optimizer."""
        out = {"scheduler": self.sched.state_dict(), "torch_rng": torch.get_rng_state(), "step": self.step}
        out["techniques"] = {t.name: t.state_dict() for t in self.techniques}
        return out

    def save_checkpoint(self) -> Path:
        meta = {"config": self.cfg.to_dict(), "baseline": self.baseline}
        if self.checkpointer is not None:
            return self.checkpointer.save(self.out, self.step, self.model, self.opt, self._run_state(), meta)
        return checkpoint.save(
            self.out, self.step, self.model.state_dict(), {"optimizer": self.opt.state_dict(), **self._run_state()},
            meta, rank=self.rank, world=self.world, barrier=collectives.barrier, keep=self.cfg.train.keep_checkpoints,
        )

    def _load(self, path: Path) -> None:
        if self.checkpointer is not None:
            rank_state = self.checkpointer.load(path, self.model, self.opt)
        else:
            rank_state = self._load_whole(path)
        self.sched.load_state_dict(rank_state["scheduler"])
        torch.set_rng_state(rank_state["torch_rng"])
        saved = rank_state.get("techniques", {})
        for t in self.techniques:
            if t.name in saved:
                t.load_state_dict(saved[t.name])
        self.step = rank_state["step"]
        log0(f"resumed from {path} at step {self.step}")

    def _load_whole(self, path: Path) -> dict:
        """The model's weights and this rank's optimizer state from ``checkpoint.save``'s files; the rest."""
        model_state, rank_state, _ = checkpoint.load(path, rank=self.rank)
        missing, unexpected = self.model.load_state_dict({k: v.to(self.device) for k, v in model_state.items()}, strict=False)
        if unexpected or any(k != "lm_head.weight" for k in missing):
            raise ConfigError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
        self.opt.load_state_dict(rank_state["optimizer"])
        return rank_state

    # ------------------------------------------------------------ the loop

    def fit(self, until: int | None = None) -> dict:
        """Train up to ``train.steps`` (or stop early after step ``until``, as an interrupted run would)."""
        c, t = self.cfg, self.cfg.train
        last = t.steps if until is None else min(until, t.steps)
        is0 = self.rank == 0
        trackers = open_trackers(c, self.out, rank=self.rank, resume=self.step > 0, start_step=self.step)
        if is0:
            (self.out / "config.json").write_text(json.dumps(c.to_dict(), indent=1))
        log0(f"model: {self.model.num_params() / 1e6:.2f} M parameters | preset {c.preset} | device {self.device} x{self.world} | "
             f"recipe {recipe_name(c, self.baseline)}")
        metrics_path = self.out / "metrics.jsonl"
        if is0 and self.step > 0:
            rundir.truncate_metrics(metrics_path, self.step)  # (rows logged after the checkpoint are replayed)
        tokens_per_step = c.data.seq_len * c.data.batch_size * c.data.grad_accum * self.world
        rows = StepRows(metrics_path if is0 else None, append=self.step > 0, tokens_per_step=tokens_per_step,
                        progress=Progress(t.steps, self.step, t.log_every, enabled=is0 and t.progress),
                        peak=self._peak, stop=self._stop, trackers=trackers, every=t.log_every)
        self.last_memory, val, first_val = None, None, None
        start_step = self.step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.step == 0 and t.eval_every > 0:
            first_val = self.evaluate()
        t_start = time.perf_counter()
        COMM.reset()
        t_first = None  # when the warm-up steps were done (the GPU included)
        n_warm = 2 if t.cuda_graph else 1
        paused = paused_all = 0.0  # time in evaluation and checkpoints, not training (after the warm-up; all)
        stop, interrupted, saved_at = StopSignals(), False, None
        check_every = 1 if self.world == 1 or self.device.type == "cpu" else max(t.log_every, 1)
        try:
            stop.__enter__()
            while self.step < last:
                info = self.train_step(measure=self.step == start_step)
                self.step += 1
                rows.add(self.step, info)  # (rows are read on the device after a log step: StepRows)
                if t_first is None and self.step - start_step >= min(n_warm, last - start_step):
                    # warm-up steps are not timed: the first (and with a CUDA graph the second, its capture)
                    self._sync()
                    t_first = time.perf_counter()
                evaluate = t.eval_every > 0 and (self.step % t.eval_every == 0 or self.step == t.steps)
                ckpt = t.ckpt_every > 0 and (self.step % t.ckpt_every == 0 or self.step == last)
                if evaluate or ckpt:
                    p0 = time.perf_counter()
                    if evaluate:
                        val = rows.val_at[self.step] = self.evaluate()
                    rows.flush()
                    if ckpt:
                        self.save_checkpoint()
                        saved_at = self.step
                    pause = time.perf_counter() - p0
                    paused_all += pause
                    if t_first is not None:  # (a pause inside the warm-up is not in the timed span)
                        paused += pause
                    rows.t_last += pause  # (the next row's rate counts training only)
                if self.step % check_every == 0 and stop.requested(self.world, self.device):
                    interrupted = True
                    break
            rows.flush()
            if interrupted and saved_at != self.step:
                self.save_checkpoint()
            self._sync()
            n_timed = self.step - start_step - n_warm
            if t_first is None:
                run_tokens, train_time = 0, 0.0
            elif n_timed > 0:
                run_tokens, train_time = n_timed * tokens_per_step, time.perf_counter() - t_first - paused
            else:  # only warm-up steps: timed whole
                run_tokens = (self.step - start_step) * tokens_per_step
                train_time = time.perf_counter() - t_start - paused_all
        finally:
            stop.__exit__()
            rows.close()
        summary = self._summary(rows.losses, val, first_val, run_tokens / max(train_time, 1e-9),
                                self.model.num_params())
        if is0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            plot_losses({recipe_name(c, self.baseline): metrics_path}, self.out / "loss.png")
        if interrupted:
            raise Interrupted(f"stopped by {signal.Signals(stop.signum).name} after step {self.step}: checkpoint, "
                              f"summary and plot written to {self.out}; continue with the same command and --resume")
        return summary

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated()
        return self.last_memory.total if self.last_memory else 0

    def _summary(self, losses, val: dict | None, first_val: dict | None, tok_s, n_params) -> dict:
        mem = self.last_memory.as_dict() if self.last_memory else {}
        tail = losses[-10:] if losses else [float("nan")]
        comm_summary = COMM.summary()
        out = {
            "recipe": recipe_name(self.cfg, self.baseline),
            "final_loss": sum(tail) / len(tail),
            "val_loss": val["loss"] if val else None,
            "initial_val_loss": first_val["loss"] if first_val else None,
            **{k: v for k, v in val_row(val or {}).items() if k != "val_loss"},
            **{f"initial_{k}": v for k, v in val_row(first_val or {}).items() if k != "val_loss"},
            "steps": self.step,
            "tokens_per_second": tok_s,
            "peak_memory_bytes": self._peak(),
            "memory": mem,
            "comm_bytes_per_step": comm_summary["bytes_per_step"],
            "comm": comm_summary,
            "world_size": self.world,
            "parameters": n_params,
            "device": str(self.device),
        }
        for t in self.techniques:
            out.update(t.summary(self.opt))
        return out

    def sample(self, prompt: str = "def ", tokens: int = 80) -> str:
        tok = self.data.tokenizer
        if tok is None or tokens <= 0:
            return ""
        g = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        idx = torch.tensor([tok.encode(prompt)], device=self.device)
        self.model.eval()
        with self._autocast():
            out = self.model.generate(idx, tokens, generator=g)
        self.model.train()
        return tok.decode(out[0].tolist())


def recipe_name(cfg: Config, baseline: bool) -> str:
    """The run's recipe: its techniques' tags joined by "+" (``reference-<rule>`` with none)."""
    if baseline:
        return "baseline"
    tags = [cls.tag(cfg) for cls in techniques.wanted(cfg)]
    return "+".join(t for t in tags if t) or f"reference-{cfg.optim.name}"
