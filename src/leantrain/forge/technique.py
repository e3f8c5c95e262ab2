"""FORGE as a technique of a run (``--forge``; :mod:`leantrain.technique`)."""

from __future__ import annotations

from leantrain.config import Config, ConfigError
from leantrain.forge.attach import attach
from leantrain.technique import Run, Technique, register


def _fsdp_refusal(cfg: Config) -> str | None:
    """Why FORGE cannot run on ``cfg``'s FSDP2 shards (one sentence), or None (:mod:`.shards`)."""
    if cfg.dist.mode != "fsdp":
        return None
    for bad, why in (
        (cfg.forge.state_dtype != "fp32", f"forge.state_dtype {cfg.forge.state_dtype} quantizes the states in "
                                          "blocks that do not follow FSDP's row shards: use --forge.state-dtype fp32"),
        (cfg.data.grad_accum > 1, "data.grad_accum > 1 would keep a whole-size accumulated gradient per layer "
                                  "between micro-batches: use --data.grad-accum 1 and a larger --data.batch-size"),
    ):
        if bad:
            return why
    return None


@register
class Forge(Technique):
    name = "forge"
    owns_step = True
    reduces_gradients = True  # (each layer's gradient is all-reduced inside backward, before its update)

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        # (with finetune.method chunkft, FORGE's update inside backward is ChunkFT's own: it steps
        # only the working set, in its row buffers' place)
        return cfg.forge.enabled and cfg.finetune.method != "chunkft"

    @classmethod
    def check(cls, cfg: Config, *, device, world: int) -> None:
        if cfg.dist.mode == "sharded":
            raise ConfigError("--forge and --dist.mode sharded both own the optimizer step; choose one")
        why = _fsdp_refusal(cfg)
        if why is not None:
            raise ConfigError(f"--forge with --dist.mode fsdp: {why}")
        if cfg.train.cuda_graph and cfg.data.grad_accum > 1:
            raise ConfigError("train.cuda_graph with FORGE needs data.grad_accum 1 (the captured backward updates "
                              "every layer; an accumulating micro-batch must not): raise --data.batch-size instead")
        if cfg.train.cuda_graph and cfg.forge.backend == "torch":
            raise ConfigError("train.cuda_graph needs FORGE on its Triton backend (--forge.backend auto or triton; "
                              "the torch backend syncs)")
        if cfg.train.cuda_graph and cfg.train.on_nonfinite == "skip":
            raise ConfigError("train.cuda_graph with FORGE needs train.on_nonfinite stop (its update runs inside "
                              "the replay, before the loss can be checked; non-finite gradient tiles are still "
                              "never stored)")

    def optimizer(self, run: Run, rule):
        c, f = run.cfg, run.cfg.forge
        # global-norm clipping needs every gradient before the first update: impossible inside
        # backward. "auto" clips by an estimate of this step's global norm (est_global, the
        # closest to the baseline on tiny/300 steps: docs/forge.md), unclipped when
        # optim.grad_clip is 0 and no forge.clip_value is given.
        clip_value = f.clip_value or c.optim.grad_clip
        clip = ("est_global" if clip_value > 0 else "none") if f.clip == "auto" else f.clip
        if f.clip == "auto" and clip != "none":
            run.log("FORGE: optim.grad_clip (global norm) cannot run inside backward; clipping by an estimate "
                    "of the step's global norm instead (forge.clip=est_global; see docs/forge.md)")
        decay_groups = [g for g in run.param_groups if isinstance(g, dict) and g.get("weight_decay") == 0.0]
        opt = attach(run.model, rule, state_dtype=f.state_dtype, stochastic_rounding=f.stochastic_rounding,
                     backend=f.backend, clip=clip, clip_value=clip_value, allreduce=run.all_reduce,
                     grad_dtype=f.grad_dtype, param_groups=decay_groups or None, fast_math=f.fast_math,
                     kernel=f.kernel, grad_accum=c.data.grad_accum, accum_dtype=f.accum_dtype,
                     accum_error_feedback=f.accum_error_feedback)
        self.opt = opt
        if c.train.cuda_graph:  # the eager first step runs the kernels the graph captures
            opt.set_device_scalars(True)
        return opt

    def before_forward(self) -> None:
        if self.opt.grad_accum > 1:  # (counts the step's micro-batches: the first k-1 accumulate)
            self.opt.before_micro_batch()

    def grad_buffers(self) -> list:
        return self.opt.accum_buffers()

    def clips_gradients(self) -> bool:
        return True  # (per layer, inside backward: forge.clip)

    def step_metrics(self, opt) -> dict:
        flags = opt.nonfinite_flags()  # (a device tensor: counted when the step is logged)
        return {} if flags is None else {"nonfinite_layers": flags.sum()}

    def capture_hooks(self, opt) -> list:
        return [opt.capture_hooks]

    def state_dict(self) -> dict:
        # under FSDP the checkpointer (DCP) saves torch's part of the optimizer's state only
        return {"optimizer_extra": self.opt.extra_state()} if self.run.cfg.dist.mode == "fsdp" else {}

    def load_state_dict(self, state: dict) -> None:
        if "optimizer_extra" in state:
            self.opt.load_extra_state(state["optimizer_extra"])

    @classmethod
    def tag(cls, cfg: Config) -> str:
        c = cfg
        return ("forge" + ("" if c.train.weights == "fp32" else "-bf16")
                + ("" if c.forge.state_dtype == "fp32" else f"-{c.forge.state_dtype}"))
