"""The fine-tuning methods as techniques of a run (``--finetune.method``; :mod:`leantrain.technique`).

``full`` is no technique: plain AdamW over every parameter. ``chunkft`` owns the step (one chunk
of the parameters gets gradients and device state at a time; under ``--dist.mode fsdp`` each rank
steps its shards' rows of the chunk, :mod:`leantrain.finetune.chunkft_sharded`). ``mezo`` and ``grzo`` are
zeroth-order: they replace forward + backward by loss evaluations at perturbed weights.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from leantrain.config import Config, ConfigError
from leantrain.finetune.chunkft import ChunkFT as ChunkFTOptimizer
from leantrain.finetune.chunkft_sharded import ShardedChunkFT
from leantrain.finetune.zo import GRZO, MeZO, noise_block_for
from leantrain.technique import Run, Technique, register


class _FinetuneMethod(Technique):
    method = ""

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.finetune.method == cls.method

    def held_bytes(self, opt) -> int:
        """Bytes the method holds beyond the weights at its peak in a step (counted tensors)."""
        return 0

    def summary(self, opt) -> dict:
        return {"method": self.method, "method_bytes": self.held_bytes(opt)}


@register
class ChunkFT(_FinetuneMethod):
    name = method = "chunkft"
    owns_step = True

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        fsdp = cfg.dist.mode == "fsdp"
        if world > 1 and not fsdp:
            raise ConfigError("finetune --method chunkft runs in one process or under --dist.mode fsdp; under "
                              "torchrun add --dist.mode fsdp or use mezo or grzo")
        why = [w for bad, w in (
            (cfg.forge.enabled, "its in-backward step (--forge) updates weight rows before FSDP reduce-scatters "
                                "their gradients: drop --forge"),
            (cfg.comm.method != "none", "the active chunk's gradients are reduce-scattered uncompressed: drop "
                                        f"--comm.method {cfg.comm.method}"),
            (cfg.dist.param_dtype != cfg.dist.reduce_dtype, "FSDP fixes each block's reduce dtype from the "
                                                            "parameters trainable at its first forward, which ChunkFT "
                                                            "changes: pass the same --dist.param-dtype and "
                                                            "--dist.reduce-dtype")) if fsdp and bad]
        if why:
            raise ConfigError("finetune.method chunkft under --dist.mode fsdp: " + "; ".join(why))
        if cfg.finetune.num_chunks < 1 or cfg.finetune.interval < 1:
            raise ConfigError("finetune.num_chunks and finetune.interval must be >= 1")
        if cfg.forge.enabled and cfg.forge.state_dtype != "fp32":
            raise ConfigError("ChunkFT keeps its chunks' optimizer state in finetune.chunk_state_dtype (fp32 or "
                              "bf16): drop --forge.state-dtype and pass --finetune.chunk-state-dtype")
        if cfg.train.cuda_graph:
            raise ConfigError("finetune.method chunkft changes which weights train between steps, which a CUDA "
                              "graph cannot follow: drop --train.cuda-graph")

    def optimizer(self, run: Run, rule):
        c, f, o = run.cfg, run.cfg.finetune, run.cfg.optim
        hyper = {"num_chunks": f.num_chunks, "interval": f.interval, "lr": o.lr, "betas": o.betas, "eps": o.eps,
                 "weight_decay": o.weight_decay, "max_norm": o.grad_clip, "state_dtype": f.chunk_state_dtype}
        try:  # (optim.grad_clip clips the active chunk's gradient: the only one there is)
            if c.dist.mode == "fsdp":  # (the model's parameters are FSDP's shards: each rank steps its rows)
                opt = ShardedChunkFT(run.model, "adamw", **hyper)
            else:
                opt = ChunkFTOptimizer(run.model, "adamw", **hyper, in_backward=c.forge.enabled,
                                       stochastic_rounding=c.forge.stochastic_rounding, seed=c.train.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        run.log(f"ChunkFT: {f.num_chunks} chunks of {', '.join(str(len(c)) for c in opt.chunks)} pieces, "
                f"each active {f.interval} step(s) in turn, {f.chunk_state_dtype} state"
                + (", stepped inside backward (FORGE)" if opt.in_backward else "")
                + (" (clipped by each chunk's norm at its last step)" if opt.in_backward and o.grad_clip > 0 else ""))
        self.opt, self.peak_bytes = opt, 0
        return opt

    def after_backward(self) -> None:  # (the active chunk's gradient rows exist now, until its step)
        self.peak_bytes = max(self.peak_bytes, self.opt.device_state_bytes())

    def clips_gradients(self) -> bool:
        return True

    def step_metrics(self, opt) -> dict:
        return {"chunk": opt.last["chunk"], "grad_norm": opt.last["grad_norm"]}

    def held_bytes(self, opt) -> int:  # (the active chunk's gradient rows and state arena, at their peak)
        return max(self.peak_bytes, opt.device_state_bytes())

    def summary(self, opt) -> dict:
        f = self.run.cfg.finetune
        return {**super().summary(opt), "num_chunks": f.num_chunks, "interval": f.interval,
                "chunk_state_dtype": f.chunk_state_dtype, "in_backward": opt.in_backward,
                "offloaded_bytes": opt.host_state_bytes()}

    @classmethod
    def tag(cls, cfg: Config) -> str:
        return "chunkft+forge" if cfg.forge.enabled else "chunkft"  # (FSDP adds its own tag)


class _ZerothOrder(_FinetuneMethod):
    owns_step = True
    zeroth_order = True
    reduces_gradients = True  # (there are none: the ranks exchange their losses in the step)

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        why = [w for bad, w in (
            (cfg.data.grad_accum > 1, "data.grad_accum 1 (its step is two forwards of one batch)"),
            (cfg.data.batch_size < 2 and cls.method == "grzo", "data.batch_size >= 2 (GRZO normalizes over the batch)"),
            (cfg.forge.enabled or cfg.agoq.enabled, "no forge or agoq (they act in backward, which it has not)"),
            (cfg.dist.mode not in ("ddp", "fsdp") or cfg.comm.method != "none",
             "dist.mode ddp or fsdp and comm.method none (only losses travel)"),
            (cfg.train.cuda_graph, "train.cuda_graph false"),
            (cfg.train.compile and cls.method == "grzo",
             "train.compile false (its forward hooks draw per-example signs that compiled blocks would not redraw)"),
            (cfg.train.weights != "fp32" and cls.method == "mezo",
             "train.weights fp32 (MeZO restores the weights by subtraction), or use grzo")) if bad]
        if why:
            raise ConfigError(f"finetune.method {cls.method} needs " + "; ".join(why))

    def step_metrics(self, opt) -> dict:
        keys = ("loss_plus", "loss_minus", "projected_grad") if self.method == "mezo" else ("delta_std",)
        return {k: opt.last[k] for k in keys if k in opt.last}

    def noise_bytes(self, opt) -> int:
        """The largest noise block a step draws (fp32)."""
        return 4 * min(opt.block, max(self._sizes(opt)))


@register
class Mezo(_ZerothOrder):
    name = method = "mezo"

    def optimizer(self, run: Run, rule):
        params = [p for p in run.model.parameters() if p.requires_grad]
        return MeZO(params, run.cfg.optim.lr, eps=run.cfg.finetune.eps, weight_decay=run.cfg.optim.weight_decay,
                    seed=run.cfg.train.seed)

    def zo_step(self, opt, losses: Callable[[], Tensor]) -> float:
        # (the mean in fp64: MeZO's (l+ - l-) / 2 eps magnifies a mean's rounding)
        return opt.step(lambda: losses().double().mean())

    def _sizes(self, opt) -> list[int]:
        return [p.numel() for g in opt.param_groups for p in g["params"]]

    def held_bytes(self, opt) -> int:
        return self.noise_bytes(opt)


@register
class Grzo(_ZerothOrder):
    name = method = "grzo"

    def optimizer(self, run: Run, rule):
        opt = GRZO(run.model, run.cfg.optim.lr, sigma=run.cfg.finetune.eps, weight_decay=run.cfg.optim.weight_decay,
                   seed=run.cfg.train.seed)
        if opt.frozen:
            run.log(f"GRZO leaves {len(opt.frozen)} parameters as they are: {', '.join(opt.frozen[:4])}"
                    f"{' ...' if len(opt.frozen) > 4 else ''}")
        return opt

    def zo_step(self, opt, losses: Callable[[], Tensor]) -> float:
        return opt.step(losses)

    def _sizes(self, opt) -> list[int]:
        return [m.weight.numel() for m in opt.modules]

    def held_bytes(self, opt) -> int:
        return opt.last["sign_bytes"] + self.noise_bytes(opt)

    def summary(self, opt) -> dict:
        return {**super().summary(opt), "grzo_frozen": opt.frozen}


__all__ = ["ChunkFT", "Grzo", "Mezo", "noise_block_for"]
