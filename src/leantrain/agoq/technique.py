"""AGoQ as a technique of a run (``--agoq``, ``--agoq.grad-bits 8``; :mod:`leantrain.technique`)."""

from __future__ import annotations

from leantrain.agoq.grad import Int8GradAccumulator
from leantrain.agoq.hooks import apply
from leantrain.agoq.policy import DERIVATIONS, Policy
from leantrain.config import Config, ConfigError
from leantrain.technique import Run, Technique, register


@register
class Agoq(Technique):
    name = "agoq"

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.agoq.enabled or cfg.agoq.grad_bits == 8

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        a = cfg.agoq
        if a.enabled and cfg.model.activation_checkpointing:
            raise ConfigError("model.activation_checkpointing and agoq.enabled: checkpointing keeps no activations "
                              "inside the blocks for AGoQ to compress; choose one (AGoQ: ~0.3x the activation "
                              "bytes at ~1.1x the step; checkpointing: the blocks' inputs only, ~1.33x the compute)")
        if a.enabled and cfg.train.compile:
            raise ConfigError("agoq.enabled and train.compile: AGoQ compresses the tensors eager blocks save, by "
                              "their role; compiled blocks save other tensors, which it would keep raw; choose one")
        if any(x not in DERIVATIONS for x in a.derive.split(",") if x):
            raise ConfigError(f"agoq.derive must be a comma list of {', '.join(DERIVATIONS)} ('' for none), "
                              f"got {a.derive!r}")
        if a.grad_bits not in (0, 8):
            raise ConfigError(f"agoq.grad_bits must be 0 (off) or 8, got {a.grad_bits}")
        if a.grad_bits == 8 and (cfg.forge.enabled or cfg.dist.mode == "sharded"):
            raise ConfigError("agoq.grad_bits 8 keeps .grad in int8 between micro-batches; FORGE and the sharded "
                              "optimizer keep no .grad of their own to compress: drop --agoq.grad-bits")
        if a.grad_bits == 8 and cfg.train.cuda_graph:
            raise ConfigError("train.cuda_graph needs agoq.grad_bits 0 (a replay overwrites the gradients)")

    def __init__(self, run: Run):
        super().__init__(run)
        a = run.cfg.agoq
        self.policy = Policy.from_config(a) if a.enabled else None
        self.packer = None  # applied at the first training forward (after the optimizer and DDP exist)
        self.resumed_noise: dict | None = None  # a checkpoint's packer state, for the packer to come
        self.grad_acc = None
        if a.grad_bits == 8:
            self.grad_acc = Int8GradAccumulator(list(run.model.parameters()))

    def before_forward(self) -> None:
        """AGoQ is applied once, persistently: a packer made and its module hooks installed per
        step would cost host time. Forwards under ``no_grad`` save nothing."""
        if self.policy is not None and self.packer is None:
            a = self.run.cfg.agoq
            # the noise's salt: the rank (the same run draws the same noise, whatever ran before it)
            self.packer = apply(self.run.model, self.policy, stage=a.pipeline_stage, replay=a.replay,
                                salt=self.run.rank)
            if self.resumed_noise is not None:
                self.packer.load_state_dict(self.resumed_noise)

    def after_micro_batch(self) -> None:
        if self.grad_acc is not None:
            self.grad_acc.accumulate()

    def after_backward(self) -> None:
        if self.grad_acc is not None:
            self.grad_acc.finalize()

    def grad_buffers(self) -> list:
        return self.grad_acc.tensors() if self.grad_acc is not None else []

    def state_dict(self) -> dict:
        if self.packer is not None:
            return {"packer": self.packer.state_dict()}
        return {"packer": self.resumed_noise} if self.resumed_noise is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.resumed_noise = state.get("packer")
        if self.packer is not None and self.resumed_noise is not None:
            self.packer.load_state_dict(self.resumed_noise)

    @classmethod
    def tag(cls, cfg: Config) -> str:
        return "agoq" if cfg.agoq.enabled else "agoq-grad8"
