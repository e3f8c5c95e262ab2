"""The sharded optimizer as a technique of a run (``--dist.mode sharded``)."""

from __future__ import annotations

from leantrain.config import Config, ConfigError
from leantrain.parallel.sharded import ShardedOptimizer
from leantrain.technique import Run, Technique, register


@register
class Sharded(Technique):
    name = "sharded"
    owns_step = True
    reduces_gradients = True

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.dist.mode == "sharded"

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        if cfg.dist.bucket_mb <= 0:
            raise ConfigError(f"dist.bucket_mb must be > 0, got {cfg.dist.bucket_mb}")
        if not cfg.optim.decay_1d:
            raise ConfigError("optim.decay_1d false needs per-parameter weight decay, which the sharded optimizer "
                              "does not have; use --dist.mode ddp or keep optim.decay_1d true")

    def optimizer(self, run: Run, rule):
        c = run.cfg
        return ShardedOptimizer(run.model, rule, intra_node_size=c.dist.intra_node_size or None,
                                compression=run.compression, max_grad_norm=c.optim.grad_clip or None,
                                bucket_mb=c.dist.bucket_mb)

    def clips_gradients(self) -> bool:
        return True  # (max_grad_norm: the reduced gradient, since its hooks may already have sent .grad)

    def step_metrics(self, opt) -> dict:
        return {} if opt.grad_norm is None else {"grad_norm": opt.grad_norm}

    @classmethod
    def tag(cls, cfg: Config) -> str:
        m = cfg.comm.method
        grads_only = m == "sdp4bit" and cfg.comm.sdp4bit.weights is False  # (the weight all-gather uncompressed)
        return "sharded" + ("" if m not in ("sdp4bit", "scape") else f"-{m}") + ("-grads" if grads_only else "")
