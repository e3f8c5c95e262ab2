"""Checkpoints of :class:`ShardedOptimizer`: per-rank shards, and a consolidated form.

- ``opt.state_dict()`` -- this rank's shard: per bucket the step count, fp32 master shard and
  rule state, plus the layout (world size, bucket boundaries, parameter sizes) and the param
  groups' hyper-parameters. Save one file per rank (``optim.rank{r}.pt``) next to the model's
  weights; ``opt.load_state_dict(sd)`` on the same world size and model resumes bit-identically
  (the stochastic-rounding streams are derived from the step count). A different layout is
  refused with a message that points to the consolidated path.
- ``opt.consolidated_state_dict()`` -- collective (every rank calls it): all-gathers the
  shards and returns, per parameter (in the order of the flattened param groups), its full
  fp32 master, rule state and step count. ``opt.load_consolidated(sd)`` takes from it the
  shard this rank owns under its own layout, so a run saved at one world size (or bucket
  size) resumes at another.
"""

from __future__ import annotations

import torch

from leantrain.runtime import collectives as C

SHARDED_FORMAT = "leantrain.sharded/1"
CONSOLIDATED_FORMAT = "leantrain.consolidated/1"


class CheckpointMixin:
    def _layout(self) -> dict:
        return {
            "world_size": self.topo.world,
            "buckets": [(b.pids, [p.numel() for p in b.params], b.padded) for b in self.buckets],
        }

    def _hyper_groups(self) -> list[dict]:
        pid = {id(p): i for i, p in enumerate(self._all_params)}
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [pid[id(p)] for p in g["params"]]}
                for g in self.param_groups]

    def _load_hyper(self, groups: list[dict]) -> None:
        if len(groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups, strict=True):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("checkpoint param groups hold different numbers of parameters than this optimizer's")
            mine.update({k: v for k, v in saved.items() if k != "params"})

    # ------------------------------------------------------------------ per-rank shards

    def state_dict(self) -> dict:
        state = {}
        for b in self.buckets:
            st = self.state[b.index]
            state[b.index] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        return {
            "format": SHARDED_FORMAT,
            "rank": self.topo.rank,
            "rule": self.rule.name,
            "compression": getattr(self.compression, "name", type(self.compression).__name__),
            "layout": self._layout(),
            "param_groups": self._hyper_groups(),
            "state": state,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != SHARDED_FORMAT:
            if state_dict.get("format") == CONSOLIDATED_FORMAT:
                return self.load_consolidated(state_dict)
            raise ValueError("not a ShardedOptimizer checkpoint (format key missing); "
                             "use load_consolidated() for consolidated ones")
        lay = state_dict["layout"]
        if lay["world_size"] != self.topo.world:
            raise ValueError(
                f"optimizer shard saved at world size {lay['world_size']}, this run has {self.topo.world}: "
                "save with opt.consolidated_state_dict() and load with opt.load_consolidated() to change it")
        if [tuple(map(tuple, (b[0], b[1]))) + (b[2],) for b in lay["buckets"]] != \
                [tuple(map(tuple, (b[0], b[1]))) + (b[2],) for b in self._layout()["buckets"]]:
            raise ValueError("optimizer shard saved with a different bucket layout (model, bucket_mb or "
                             "compression changed): use consolidated_state_dict()/load_consolidated()")
        if state_dict["rank"] != self.topo.rank:
            raise ValueError(f"this is rank {state_dict['rank']}'s shard, loaded on rank {self.topo.rank}")
        if state_dict.get("rule") not in (None, self.rule.name):
            raise ValueError(f"checkpoint was made with rule {state_dict['rule']!r}, this optimizer uses {self.rule.name!r}")
        self._load_hyper(state_dict["param_groups"])
        with torch.no_grad():
            for b in self.buckets:
                saved, st = state_dict["state"][b.index], self.state[b.index]
                for k, v in saved.items():
                    if torch.is_tensor(v):
                        st[k].copy_(v)
                    else:
                        st[k] = v
        self.compression.resume({b.index: self.state[b.index] for b in self.buckets}, self.topo)

    # ------------------------------------------------------------------ consolidated

    def consolidated_state_dict(self, *, device="cpu") -> dict:
        """Every parameter's full master weights and rule state (collective: call on all ranks)."""
        n = len(self._all_params)
        params: list[dict] = [dict() for _ in range(n)]
        keys = ("master", *self.rule.state_names)
        with torch.no_grad():
            for b in self.buckets:
                st = self.state[b.index]
                for k in keys:
                    full = torch.empty(b.padded, dtype=st[k].dtype, device=st[k].device)
                    C.all_gather_into_tensor(full, st[k].contiguous(), group=self.group, scope="world")
                    for pid, p, off in zip(b.pids, b.params, b.offsets, strict=True):
                        params[pid][k] = full[off:off + p.numel()].view(p.shape).to(device, copy=True)
                for pid in b.pids:
                    params[pid]["step"] = st["step"]
        return {
            "format": CONSOLIDATED_FORMAT,
            "rule": self.rule.name,
            "names": self.param_names,
            "param_groups": self._hyper_groups(),
            "params": params,
        }

    def load_consolidated(self, state_dict: dict) -> None:
        """Take this rank's shard of a :meth:`consolidated_state_dict` (any world size)."""
        if state_dict.get("format") != CONSOLIDATED_FORMAT:
            raise ValueError("load_consolidated needs the dict returned by consolidated_state_dict()")
        saved = state_dict["params"]
        if len(saved) != len(self._all_params):
            raise ValueError(f"checkpoint holds {len(saved)} parameters, this optimizer {len(self._all_params)}")
        for i, (s, p) in enumerate(zip(saved, self._all_params, strict=True)):
            if tuple(s["master"].shape) != tuple(p.shape):
                name = self.param_names[i] if self.param_names else f"#{i}"
                raise ValueError(f"parameter {name}: checkpoint shape {tuple(s['master'].shape)}, model {tuple(p.shape)}")
        if state_dict.get("rule") not in (None, self.rule.name):
            raise ValueError(f"checkpoint was made with rule {state_dict['rule']!r}, this optimizer uses {self.rule.name!r}")
        self._load_hyper(state_dict["param_groups"])
        keys = ("master", *self.rule.state_names)
        with torch.no_grad():
            for b in self.buckets:
                st = self.state[b.index]
                lo_me, hi_me = b.start, b.start + b.shard
                for k in keys:
                    st[k].zero_()
                    for pid, p, off in zip(b.pids, b.params, b.offsets, strict=True):
                        lo, hi = max(off, lo_me), min(off + p.numel(), hi_me)
                        if lo < hi:
                            src = saved[pid][k].reshape(-1)[lo - off:hi - off]
                            st[k][lo - lo_me:hi - lo_me].copy_(src)
                st["step"] = max(saved[pid]["step"] for pid in b.pids)
                for k in set(st) - {"step", *keys}:  # compressor state (SCAPE's residual): per rank, not kept
                    st[k].zero_()
        self.compression.resume({b.index: self.state[b.index] for b in self.buckets}, self.topo)


__all__ = ["CheckpointMixin", "SHARDED_FORMAT", "CONSOLIDATED_FORMAT"]
