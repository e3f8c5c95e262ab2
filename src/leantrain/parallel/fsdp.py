"""PyTorch FSDP2 as a technique of a run (``--dist.mode fsdp``; docs/fsdp.md).

Every block (``model.layers[i]``) and then the root model are wrapped by
``torch.distributed.fsdp.fully_shard``: each rank keeps ``1/world`` of every weight, gradient and
optimizer state as a ``DTensor`` shard; a block's weights are all-gathered before its forward
and its backward and freed after, and its gradients are reduce-scattered as its backward ends.
With ``dist.replicate`` R > 1 the mesh is 2-D (replicate, shard): HSDP, each of R replicas
sharding over ``world / R`` ranks, the gradients then all-reduced across replicas.

The optimizer is the matching ``torch.optim`` one (AdamW, SGD) over the sharded parameters
(``foreach``: one kernel over many shards). ``no_sync()`` keeps the gradients of the
micro-batches before the last one unreduced (``FSDPModule.set_requires_gradient_sync``).
Gradient clipping is the trainer's ``clip_grad_norm_``: over ``DTensor`` gradients it returns
the global norm. Checkpoints go through ``torch.distributed.checkpoint``
(:class:`leantrain.runtime.dcp.DcpCheckpointer`): a run resumes at another world size.

FSDP's all-gathers, reduce-scatters and HSDP all-reduces go through counted collectives
(:mod:`leantrain.parallel.fsdp_comm`). With ``--comm.method sdp4bit`` the communication technique
offers its compressor (``Run.compression``) and every ``fully_shard``ed module reduce-scatters
through SDP4Bit's two-level 4-bit path; its weight half has no counterpart here (FSDP keeps no
whole weights between steps to quantize differences against) and is refused. With
``--comm.method int8`` the reduce-scatter sends int8 codes and fp32 scales
(:class:`leantrain.comm.Int8ReduceScatter`). Either one's call count (its rounding seed) is in
this technique's state.

The zeroth-order methods (``--finetune.method mezo|grzo``, :mod:`leantrain.finetune.zo`) step the
shards themselves: each rank perturbs and updates its rows with the noise a single process draws
for them; the forwards all-gather the weights as FSDP does, and the ranks exchange their losses.
Their optimizer state (a step count and a seed) is saved whole with each rank's state.

ChunkFT (``--finetune.method chunkft``, :mod:`leantrain.finetune.chunkft_sharded`) steps this
rank's rows of the active chunk; its optimizer state (those rows) is saved with each rank's state
too, so its checkpoints resume at the same world size only.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from leantrain.config import Config, ConfigError
from leantrain.parallel import fsdp_comm
from leantrain.runtime import collectives, distributed
from leantrain.technique import Run, Technique, register

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ZEROTH_ORDER = ("mezo", "grzo")  # finetune.method values whose steps are forwards only (finetune/zo.py)
# finetune.method values whose optimizer state is saved with each rank's state, not through DCP
# (ChunkFT's is this rank's rows of its chunks, finetune/chunkft_sharded.py)
WHOLE_STATE = (*ZEROTH_ORDER, "chunkft")
# the communication methods FSDP does not run: why, and the mode that runs each
OTHER_MODES = {
    "gift": ("compresses DDP's all-reduce of whole gradients, which FSDP reduce-scatters", "ddp"),
    "scape": ("masks the sharded optimizer's traffic by that optimizer's first moment, which FSDP's torch "
              "optimizer does not share", "sharded"),
}


class _GradientSync:
    """``no_sync()``: the trainer enters it for every micro-batch but the last; FSDP then
    accumulates the unsharded gradients and reduce-scatters them in the last one's backward."""

    fsdp_model: nn.Module

    @contextlib.contextmanager
    def no_sync(self):
        self.fsdp_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.fsdp_model.set_requires_gradient_sync(True)


class FsdpAdamW(_GradientSync, torch.optim.AdamW):
    """``torch.optim.AdamW`` over FSDP-sharded parameters, with :meth:`no_sync`."""

    def __init__(self, params, *, model: nn.Module, **kw):
        super().__init__(params, **kw)
        self.fsdp_model = model


class FsdpSGD(_GradientSync, torch.optim.SGD):
    """``torch.optim.SGD`` over FSDP-sharded parameters, with :meth:`no_sync` and leantrain's
    decoupled weight decay (``p = (1 - lr wd) p - lr d``, :class:`leantrain.optim.rules.SGD`):
    each group's ``weight_decay`` is moved to ``decoupled_weight_decay`` and applied before
    torch's step, which then sees none (its own decay is added to the gradient)."""

    def __init__(self, params, *, model: nn.Module, weight_decay: float = 0.0, **kw):
        params = list(params)
        groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
        for g in groups:
            g["decoupled_weight_decay"] = g.pop("weight_decay", weight_decay)
        super().__init__(groups, weight_decay=0.0, **kw)
        self.fsdp_model = model

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            if g["decoupled_weight_decay"]:
                for p in g["params"]:
                    if p.grad is not None:
                        p.mul_(1.0 - g["lr"] * g["decoupled_weight_decay"])
        return super().step(closure)


def _refusal(cfg: Config, device: torch.device, world: int) -> str | None:
    """Why ``cfg`` cannot run under FSDP (one sentence), or None."""
    d = cfg.dist
    if world % d.replicate:
        return (f"dist.replicate ({d.replicate}) must divide the number of processes ({world}); pass "
                f"--dist.replicate 1 or a divisor of {world}")
    c = cfg.comm
    what, mode = OTHER_MODES.get(c.method, ("", ""))
    shards = world // d.replicate  # (ranks of a shard group; replicate divides world, checked above)
    for bad, why in (
        (cfg.forge.enabled and c.method != "none", f"FORGE reduce-scatters each layer's weight gradient itself, "
                                                    f"uncompressed: drop --comm.method {c.method} with --forge under FSDP"),
        (c.method in OTHER_MODES, f"comm.method {c.method} {what}: use it with --dist.mode {mode} (FSDP compresses "
                                  "its reduce-scatter with --comm.method sdp4bit or int8)"),
        (c.method == "sdp4bit" and c.sdp4bit.weights, "comm.sdp4bit.weights quantizes weight differences against "
                                                      "whole weights every rank keeps between steps, which FSDP does "
                                                      "not keep: use --dist.mode sharded for SDP4Bit's weight half, "
                                                      "or drop it to run its gradient half under FSDP"),
        (c.method == "sdp4bit" and d.intra_node_size > 0 and shards % d.intra_node_size,
         f"dist.intra_node_size ({d.intra_node_size}) must divide the {shards} ranks each FSDP shard group holds "
         "for SDP4Bit's two-level reduce-scatter: pass a divisor of it, or 0 for one node"),
        (cfg.train.cuda_graph, "train.cuda_graph cannot capture FSDP's collectives: drop --train.cuda-graph"),
        (cfg.agoq.grad_bits == 8, "agoq.grad_bits 8 keeps whole int8 gradients between micro-batches, which "
                                  "FSDP reduce-scatters in backward: drop --agoq.grad-bits"),
        (cfg.optim.name not in ("adamw", "sgd"), f"optim.name {cfg.optim.name} has no torch.optim counterpart to "
                                                 "step sharded parameters: use --optim.name adamw or sgd"),
        (cfg.train.weights != "fp32", "train.weights bf16 would step bf16 shards without stochastic rounding: "
                                      "keep fp32 weights and pass --dist.param-dtype bf16"),
        (d.cpu_offload and device.type != "cuda", "dist.cpu_offload moves shards from a GPU to CPU memory: "
                                                  "drop it on a CPU run"),
    ):
        if bad:
            return why
    return None


@register
class Fsdp(Technique):
    name = "fsdp"
    owns_step = True
    yields_step = True  # (with --forge, FORGE's updates step the shards: forge/shards.py)
    reduces_gradients = True
    baseline_ok = True  # (its optimizer is torch's AdamW over the shards)

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        return cfg.dist.mode == "fsdp"

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        why = _refusal(cfg, device, world)
        if why is not None:
            raise ConfigError(f"--dist.mode fsdp: {why}")

    def __init__(self, run: Run):
        super().__init__(run)
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        d, model = run.cfg.dist, run.model
        distributed.ensure_group(run.device)  # (a run of one process has none: FSDP needs one)
        # the groups name their parameters: fully_shard replaces every parameter by a DTensor one
        names = {id(p): n for n, p in model.named_parameters()}
        self.group_names = [[names[id(p)] for p in g["params"]] if isinstance(g, dict) else names[id(g)]
                            for g in run.param_groups]
        shape, dims = ((d.replicate, run.world // d.replicate), ("replicate", "shard")) if d.replicate > 1 \
            else ((run.world,), ("shard",))
        self.mesh = distributed.device_mesh(run.device.type, shape, dims)
        kw = {"mesh": self.mesh,
              "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[d.param_dtype], reduce_dtype=DTYPES[d.reduce_dtype]),
              "offload_policy": CPUOffloadPolicy() if d.cpu_offload else OffloadPolicy()}
        for block in model.layers:
            fully_shard(block, **kw)
        # the root keeps its weights unsharded after forward for the backward that follows; a
        # zeroth-order step has none, and perturbs or updates the shards before the next forward,
        # which must all-gather them again
        self.forwards_only = run.cfg.finetune.method in ZEROTH_ORDER
        fully_shard(model, **kw, reshard_after_forward=True if self.forwards_only else None)
        run.param_groups = self.param_groups()  # (for a technique that owns the step instead: FORGE)
        self.sharded_modules = [*model.layers, model]
        self.compressed_reduce_scatter = None  # (SDP4Bit's or int8's, once optimizer() installed it)
        self.installed = False
        # without a compressor the collectives go in now: another technique may build the optimizer
        # (FORGE, MeZO, GRZO), and then optimizer() below is not called
        if run.cfg.comm.method == "none":
            self.install_collectives(run)

    def param_groups(self) -> list:
        """The run's parameter groups over the sharded parameters (the same names, the same order)."""
        params = dict(self.run.model.named_parameters())
        return [{**g, "params": [params[n] for n in names]} if isinstance(g, dict) else params[names]
                for g, names in zip(self.run.param_groups, self.group_names, strict=True)]

    def install_collectives(self, run: Run) -> None:
        """The counted collectives, and the compressed reduce-scatter of a communication technique's
        compressor (``run.compression``). Called from :meth:`optimizer`: the communication
        techniques are built after this one and offer their compressor then."""
        if self.installed:
            return
        self.compressed_reduce_scatter = fsdp_comm.install(
            self.sharded_modules, self.mesh, compression=run.compression,
            intra_node_size=run.cfg.dist.intra_node_size or None)
        self.installed = True

    def optimizer(self, run: Run, rule):
        self.install_collectives(run)
        o = run.cfg.optim
        if o.name == "adamw":
            return FsdpAdamW(self.param_groups(), model=run.model, lr=o.lr, betas=o.betas, eps=o.eps,
                             weight_decay=o.weight_decay, foreach=True)
        return FsdpSGD(self.param_groups(), model=run.model, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                       weight_decay=o.weight_decay, foreach=True)

    def state_dict(self) -> dict:
        """The compressed reduce-scatter's call count (its stochastic rounding's seed), if any."""
        rs = self.compressed_reduce_scatter
        return {"reduce_scatter": rs.state_dict()} if rs is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.compressed_reduce_scatter is not None and "reduce_scatter" in state:
            self.compressed_reduce_scatter.load_state_dict(state["reduce_scatter"])

    def checkpointer(self):
        """DCP checkpoints: each rank writes its shards; a resume may use another world size."""
        from leantrain.runtime.dcp import DcpCheckpointer

        return DcpCheckpointer(rank=self.run.rank, world=self.run.world, keep=self.run.cfg.train.keep_checkpoints,
                               barrier=collectives.barrier,
                               whole_optimizer=self.run.cfg.finetune.method in WHOLE_STATE)

    @classmethod
    def tag(cls, cfg: Config) -> str:
        d = cfg.dist
        return (("hsdp" if d.replicate > 1 else "fsdp") + ("-bf16" if d.param_dtype == "bf16" else "")
                + (f"-{cfg.comm.method}" if cfg.comm.method in ("sdp4bit", "int8") else ""))
