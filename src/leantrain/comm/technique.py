"""The compressed collectives as techniques of a run (``[comm]``; :mod:`leantrain.technique`).

- ``int8``: AGoQ's precision-preserving 8-bit all-reduce: DDP's comm hook, and the per-layer
  all-reduce a technique that reduces inside backward (FORGE) uses (``Run.all_reduce``); under
  FSDP its first phase is FSDP's gradient reduce-scatter (``Run.compression``:
  :class:`leantrain.comm.Int8ReduceScatter`).
- ``gift``: GIFT's FP8 / NVFP4 all-reduce in K-FAC-whitened coordinates, after backward.
- ``sdp4bit`` / ``scape``: the compressor of the sharded optimizer (``Run.compression``); SDP4Bit's
  gradient half also becomes FSDP's reduce-scatter (:mod:`leantrain.parallel.fsdp`).
"""

from __future__ import annotations

from leantrain.comm.fsdp import Int8ReduceScatter
from leantrain.comm.gift import GIFT
from leantrain.comm.int8_allreduce import Int8AllReduceState, int8_all_reduce, int8_allreduce_hook
from leantrain.comm.scape import SCAPE
from leantrain.comm.sdp4bit import SDP4Bit
from leantrain.config import Config, ConfigError
from leantrain.technique import Run, Technique, register


@register
class Int8AllReduce(Technique):
    name = "int8"

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.comm.method == "int8"

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        if cfg.dist.mode not in ("ddp", "fsdp"):
            raise ConfigError("comm.method int8 compresses DDP's all-reduce and FSDP's reduce-scatter of the "
                              "gradients: use it with --dist.mode ddp or fsdp (with --dist.mode sharded use "
                              "--comm.method sdp4bit or scape)")

    def __init__(self, run: Run):
        super().__init__(run)
        run.all_reduce = int8_all_reduce
        self.hook_state = Int8AllReduceState(None)
        if run.cfg.dist.mode == "fsdp":  # (FSDP installs it as its reduce-scatter and checkpoints its calls)
            run.compression = Int8ReduceScatter()

    def ddp_comm_hook(self):
        return self.hook_state, int8_allreduce_hook

    def state_dict(self) -> dict:
        return self.hook_state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.hook_state.load_state_dict(state)

    @classmethod
    def tag(cls, cfg: Config) -> str:
        return "ddp-int8" if cfg.dist.mode == "ddp" else ""  # (FSDP names its reduce-scatter)


@register
class Gift(Technique):
    name = "gift"

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.comm.method == "gift"

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        g = cfg.comm.gift
        if cfg.dist.mode != "ddp" or cfg.forge.enabled:
            raise ConfigError("comm.method gift reduces whole gradients after backward: use it with --dist.mode ddp "
                              "and without --forge, whose per-layer reduction runs inside backward (with FORGE use "
                              "--comm.method int8)")
        if g.min_gain < 0:
            raise ConfigError(f"comm.gift.min_gain must be >= 0 (0: every layer whitened), got {g.min_gain}")
        if g.stat_tokens < 0:
            raise ConfigError(f"comm.gift.stat_tokens must be >= 0 (0: every token), got {g.stat_tokens}")
        if g.rank < 0 or g.refresh_every < 1:
            raise ConfigError(f"comm.gift.rank must be >= 0 (0: full rank) and comm.gift.refresh_every >= 1, got "
                              f"{g.rank} and {g.refresh_every}")

    def __init__(self, run: Run):
        super().__init__(run)
        g = run.cfg.comm.gift
        self.gift = None
        if run.world > 1:  # (one process: nothing to reduce)
            self.gift = GIFT(run.model, rank=g.rank or None, refresh_every=g.refresh_every, min_numel=g.min_numel,
                             whiten=g.whiten, format=g.format, transform_dtype=g.transform_dtype,
                             min_gain=g.min_gain, stat_tokens=g.stat_tokens)

    def ddp_comm_hook(self):
        return (None, GIFT.ddp_noop_hook) if self.gift is not None else None  # (GIFT reduces after backward)

    def after_backward(self) -> None:
        if self.gift is not None:  # every gradient, in model order (DDP's hook sent nothing)
            self.gift.reduce_gradients()

    def state_dict(self) -> dict:
        return self.gift.state_dict() if self.gift is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.gift is not None and state:
            self.gift.load_state_dict(state)

    @classmethod
    def tag(cls, cfg: Config) -> str:
        g = cfg.comm.gift
        fmt = "fp8" if g.format == "e4m3" else g.format
        if not g.whiten:  # (GIFT's all-reduce in unwhitened coordinates)
            return f"ddp-{fmt}"
        return "ddp-gift" + ("" if fmt == "fp8" else f"-{fmt}")


@register
class ShardCompression(Technique):
    name = "shard-compression"

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.comm.method in ("sdp4bit", "scape")

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        c = cfg.comm
        if c.method == "sdp4bit" and cfg.dist.mode not in ("sharded", "fsdp"):
            raise ConfigError("comm.method sdp4bit compresses the traffic of sharded data parallelism: add "
                              "--dist.mode sharded (gradients and weights) or --dist.mode fsdp (gradients)")
        if c.method == "scape" and cfg.dist.mode != "sharded":
            raise ConfigError("comm.method scape compresses the sharded optimizer's traffic: add --dist.mode sharded")
        if c.method == "scape" and cfg.optim.name == "sgd" and cfg.optim.momentum == 0:
            raise ConfigError("comm.method scape takes its masks from the first moment: use --optim.name adams "
                              "(or adamw, lion, sgd with momentum)")
        if c.method == "scape" and not 0 < c.scape.density <= 1:
            raise ConfigError(f"comm.scape.density must be in (0, 1], got {c.scape.density}")
        if c.method == "scape" and not 0 <= c.scape.beta1 < 1:
            raise ConfigError(f"comm.scape.beta1 must be in [0, 1) (0: the optimizer's), got {c.scape.beta1}")
        if c.method == "scape" and not 0 <= c.scape.explore < 1:
            raise ConfigError(f"comm.scape.explore must be in [0, 1), got {c.scape.explore}")
        if c.method == "scape" and c.scape.warmup is not None and c.scape.warmup < 0:
            raise ConfigError(f"comm.scape.warmup must be >= 0 steps, got {c.scape.warmup}")
        if c.method == "scape" and c.scape.catch_up is not None and c.scape.catch_up < 0:
            raise ConfigError(f"comm.scape.catch_up must be >= 0 steps (0: off), got {c.scape.catch_up}")

    def __init__(self, run: Run):
        super().__init__(run)
        c = run.cfg.comm
        if c.method == "sdp4bit":  # (the weight half: comm.sdp4bit.weights, else on where the mode has it)
            weights = c.sdp4bit.weights if c.sdp4bit.weights is not None else run.cfg.dist.mode == "sharded"
            run.compression = SDP4Bit(quantize_weights=weights)
        else:
            s = c.scape
            run.compression = SCAPE(s.density, explore=s.explore, catch_up=s.catch_up, score=s.score,
                                    dense_steps=s.dense_steps, per_tensor=s.per_tensor, catch_up_mode=s.catch_up_mode,
                                    beta1=s.beta1 or None, warmup=s.warmup)

    @classmethod
    def tag(cls, cfg: Config) -> str:
        return ""  # (the sharded optimizer names its compressor)
