"""FORGE gradient accumulation (``data.grad_accum 4``) against one 4x batch, per ``forge.accum_dtype``.

Run through ``benchmarks/bench_convergence.py --forge-accum`` (its module docstring has the
command). Both runs of a pair see the same rows each step: the accumulated run's micro-batch
``m`` is rows ``m·B .. (m+1)·B`` of the one-batch run's step (:class:`SameRows`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

import leantrain as lt
from leantrain import config
from leantrain.model import Llama

K = 4
SETTINGS = {
    "bf16": {"forge.accum_dtype": "bf16"},
    "fp32": {"forge.accum_dtype": "fp32"},
    "int8": {"forge.accum_dtype": "int8"},
    "int8-noef": {"forge.accum_dtype": "int8", "forge.accum_error_feedback": "false"},
}


class SameRows:
    """A run's data whose micro-batch ``micro`` of ``batch_size`` rows is that slice of the step's
    batch of ``k * batch_size`` rows."""

    def __init__(self, data, k: int):
        self.data, self.k = data, k

    def __getattr__(self, name):
        return getattr(self.data, name)

    def batch(self, split, seq_len, batch_size, *, micro=0, **kw):
        x, y = self.data.batch(split, seq_len, batch_size * self.k, micro=0, **kw)
        rows = slice(micro * batch_size, (micro + 1) * batch_size)
        return x[rows], y[rows]


def _losses(cfg, out: Path, k: int) -> list[float]:
    from leantrain.train.trainer import Trainer

    tr = Trainer(cfg, out)
    tr.data = SameRows(tr.data, k)
    tr.fit()
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def bytes_per_fused_parameter(cfg) -> float:
    """Bytes the accumulation buffers hold per fused parameter after one accumulating micro-batch."""
    torch.manual_seed(0)
    model = Llama(cfg.model)
    opt = lt.forge.attach(model, lt.optim.SGD(lr=0.01), backend="torch", grad_accum=K,
                          accum_dtype=cfg.forge.accum_dtype, accum_error_feedback=cfg.forge.accum_error_feedback)
    rows = torch.randint(0, cfg.model.vocab_size, (1, 17))
    opt.before_micro_batch()
    model(rows[:, :-1], rows[:, 1:]).backward()
    held = sum(t.numel() * t.element_size() for t in opt.accum_buffers())
    fused = sum(p.numel() for layer in opt.layers for p in (layer.weight, layer.bias) if p is not None)
    return held / fused


def forge_accum(args) -> int:
    sets = dict(kv.split("=", 1) for kv in args.set)
    base = config.build(args.preset, overrides=sets)
    batch = base.data.batch_size
    if batch % K:
        raise SystemExit(f"data.batch_size {batch} does not split into {K} micro-batches")
    common = {**sets, "forge.enabled": "true", "train.steps": str(args.steps), "train.eval_every": "0",
              "train.ckpt_every": "0", "train.sample_tokens": "0", "train.progress": "false"}
    tmp = Path(tempfile.mkdtemp(prefix="forge-accum-"))
    result = {"what": f"FORGE, {args.preset} preset, {args.steps} steps: {K} micro-batches of {batch // K} rows vs "
                      f"one batch of the same {batch} rows; loss ratio = mean training loss accumulated / one batch",
              "command": "PYTHONPATH=src python3 benchmarks/bench_convergence.py --forge-accum "
                         f"--preset {args.preset} --steps {args.steps}" + "".join(f" --set {kv}" for kv in args.set)
                         + f" --out {args.out}",
              "settings": {}}
    for name, ov in SETTINGS.items():
        cfg_acc = config.build(args.preset, overrides={**common, **ov, "data.batch_size": str(batch // K),
                                                       "data.grad_accum": str(K)})
        cfg_big = config.build(args.preset, overrides={**common, **ov})
        acc, big = _losses(cfg_acc, tmp / f"{name}-acc", K), _losses(cfg_big, tmp / f"{name}-big", 1)
        row = {"config": ov, "loss_ratio_all": sum(acc) / sum(big), "loss_ratio_last10": sum(acc[-10:]) / sum(big[-10:]),
               "final_loss_accumulated": acc[-1], "final_loss_one_batch": big[-1],
               "bytes_per_fused_parameter": bytes_per_fused_parameter(cfg_acc)}
        result["settings"][name] = row
        print(f"{name:>10}: loss ratio {row['loss_ratio_all']:.5f} (last 10: {row['loss_ratio_last10']:.5f}), "
              f"{row['bytes_per_fused_parameter']:.4f} B/param", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0
