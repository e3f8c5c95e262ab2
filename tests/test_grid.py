"""The compatibility grid: every recipe against every way of running it, each cell computed by
running it (the tiny model, gloo on loopback for several ranks).

A cell is ``ok`` when the run works and passes the column's check, else the exact sentence the
user gets (a ``ConfigError``'s message, or what went wrong). The test compares every cell with
the committed grid (``benchmarks/results/grid/<date>_cpu.json``, the newest), so the table in
``docs/compatibility.md`` (``benchmarks/report.py`` renders it) cannot drift from the code.
``pytest tests/test_grid.py --grid-out FILE`` writes a new grid instead of comparing.

Columns and their checks:
- one device / DDP / sharded / FSDP2 / HSDP: two steps (1, 2, 2, 2 and 4 ranks; HSDP 2 x 2), a
  finite loss;
- grad accumulation: two micro-batches a step, a finite loss;
- compile: ``train.compile`` (``aot_eager``) gives the eager run's losses;
- resume: two steps, then ``--resume`` to four, equals four steps straight, bit for bit;
- resume at another world size (FSDP2, whose DCP checkpoints reshard): two steps on 2 ranks,
  resumed to four on 1 rank;
- HF export: the run's checkpoint written as a Hugging Face directory that ``transformers`` loads
  with no missing or unexpected key;
- Llama / Qwen2 / Mistral: two steps from a tiny random ``transformers`` model of that family.
Recipes that send gradients (int8 all-reduce, SDP4Bit, SCAPE, GIFT) run the columns that do not
choose the mode on 2 ranks, the others on one.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import pytest
import torch

from helpers import TINY_OVERRIDES, tiny_config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "grid"
OK = "ok"
RECIPES: dict[str, dict] = {
    "baseline": {"baseline": True},
    "FORGE": {"forge.enabled": "true"},
    "FORGE bf16 + SR, int8 states": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "int8"},
    "AGoQ": {"agoq.enabled": "true"},
    "FORGE + AGoQ": {"forge.enabled": "true", "agoq.enabled": "true"},
    "int8 all-reduce": {"comm.method": "int8"},
    "SDP4Bit": {"dist.mode": "sharded", "comm.method": "sdp4bit"},
    "SCAPE": {"dist.mode": "sharded", "comm.method": "scape", "optim.name": "adams"},
    "GIFT": {"comm.method": "gift"},
    "ChunkFT": {"finetune.method": "chunkft"},
    "GRZO": {"finetune.method": "grzo"},
    "MeZO": {"finetune.method": "mezo"},
}
SENDS = ("int8 all-reduce", "SDP4Bit", "SCAPE", "GIFT")  # (their natural world: 2 ranks)
MODES = {"one device": (1, {}), "DDP": (2, {"dist.mode": "ddp"}), "sharded": (2, {"dist.mode": "sharded"}),
         "FSDP2": (2, {"dist.mode": "fsdp"}), "HSDP": (4, {"dist.mode": "fsdp", "dist.replicate": "2"})}
FAMILIES = ("Llama", "Qwen2", "Mistral")
RESHARD = "resume at another world size (FSDP2)"
COLUMNS = (*MODES, "grad accumulation", "compile", "resume", RESHARD, "HF export", *FAMILIES)
BASE = {"train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "2", "train.log_every": "1"}


def _natural(recipe: str) -> int:
    return 2 if recipe in SENDS else 1


def _world(recipe: str, column: str) -> int:
    if column in MODES:
        return MODES[column][0]
    return 2 if column == RESHARD else _natural(recipe)


def _fit(corpus, out: Path, over: dict, *, resume: bool = False, overwrite: bool = True,
         model_from_source: bool = False) -> list[float]:
    from leantrain import config as C
    from leantrain.train.trainer import Trainer

    over = dict(over)
    baseline = bool(over.pop("baseline", False))
    if model_from_source:  # (the tiny test sizes of the model would disagree with the source's)
        cfg = C.build("tiny", overrides={**{k: v for k, v in TINY_OVERRIDES.items() if not k.startswith("model.")},
                                         "data.path": str(corpus), **BASE, **over})
    else:
        cfg = tiny_config(corpus, **{**BASE, **over})
    Trainer(cfg, out, baseline=baseline, resume=resume, overwrite=overwrite and not resume).fit()
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    if not all(math.isfinite(v) for v in losses):
        raise AssertionError(f"non-finite loss {losses}")
    return losses


def _weights(out: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


def _check(recipe: str, column: str, corpus, tmp: Path, hf_dirs: dict) -> None:
    """Run one cell; raise on failure (a ConfigError's sentence is the cell)."""
    over = {k: v for k, v in RECIPES[recipe].items()}
    if column in MODES:
        over.update(MODES[column][1])
        _fit(corpus, tmp / "run", over)
    elif column == "grad accumulation":
        _fit(corpus, tmp / "run", {**over, "data.grad_accum": "2"})
    elif column == "compile":
        eager = _fit(corpus, tmp / "eager", over)
        compiled = _fit(corpus, tmp / "compiled", {**over, "train.compile": "true", "train.compile_backend": "aot_eager"})
        if compiled != pytest.approx(eager, rel=1e-5, abs=1e-6):
            raise AssertionError(f"compiled losses {compiled} differ from eager {eager}")
    elif column == "resume":
        _fit(corpus, tmp / "a", {**over, "train.steps": "4"})
        _fit(corpus, tmp / "b", over)
        _fit(corpus, tmp / "b", {**over, "train.steps": "4"}, resume=True)
        wa, wb = _weights(tmp / "a", 4), _weights(tmp / "b", 4)
        if any(not torch.equal(wa[k], wb[k]) for k in wa):
            raise AssertionError("the resumed run's weights differ from an uninterrupted run's")
    elif column == "HF export":
        _fit(corpus, tmp / "run", over)
        _export_loads(tmp / "run", tmp / "hf")
    else:  # a model family: its architecture, the run's other settings
        _fit(corpus, tmp / "run", {**over, "train.init_from": str(hf_dirs[column])}, model_from_source=True)


def _export_loads(run: Path, out: Path) -> None:
    import argparse

    import transformers

    from leantrain.cli import cmd_export
    from leantrain.runtime import collectives

    if collectives.rank() != 0:  # (one rank writes the export; cli.main would close the process group)
        return
    cmd_export(argparse.Namespace(source=str(run), out=str(out), overwrite=False), [])
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise AssertionError(f"the export loads with missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")


def _status(run, tmp: Path) -> str:
    """``ok`` when ``run()`` returns, else the sentence a user gets (this machine's paths as ``RUN``)."""
    from leantrain.config import ConfigError
    from leantrain.runtime.checkpoint import CheckpointError

    try:
        run()
    except (ConfigError, CheckpointError) as e:
        return _plain(str(e), tmp)
    except Exception as e:  # noqa: BLE001  (a failure is a cell too: the grid shows it)
        return _plain(f"fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else traceback.format_exc(limit=1)}",
                      tmp)
    return OK


def cell(recipe: str, column: str, corpus, tmp: Path, hf_dirs: dict) -> str:
    """``ok``, or the sentence a user gets."""
    tmp.mkdir(parents=True, exist_ok=True)
    return _status(lambda: _check(recipe, column, corpus, tmp, hf_dirs), tmp)


def _plain(message: str, tmp: Path) -> str:
    """The message without this machine's directories (the run directory reads ``RUN``)."""
    return message.replace(str(tmp / "run"), "RUN").replace(str(tmp), "RUN")


def _resume_elsewhere(rank: int, recipe: str, corpus, tmp: Path) -> str:
    """Two FSDP2 steps on 2 ranks (this worker is one of them); the caller resumes on one."""
    return _status(lambda: _fit(corpus, tmp / "run", {**RECIPES[recipe], "dist.mode": "fsdp"}), tmp)


def _worker(rank: int, world: int, cells: list, corpus, tmp: Path, hf_dirs: dict) -> dict:
    torch.set_num_threads(1)
    out = {}
    for recipe, column in cells:
        where = tmp / f"{recipe}-{column}".replace(" ", "_").replace("/", "_")
        if column == RESHARD:
            out[(recipe, column)] = _resume_elsewhere(rank, recipe, corpus, where)
        else:
            out[(recipe, column)] = cell(recipe, column, corpus, where, hf_dirs)
    return out


def compute(corpus, tmp: Path, hf_dirs: dict) -> dict[str, dict[str, str]]:
    """Every cell: one-process cells here, the others in one gloo job per world size."""
    from dist_utils import run_distributed

    grid: dict[str, dict[str, str]] = {r: {} for r in RECIPES}
    by_world: dict[int, list] = {}
    for recipe in RECIPES:
        for column in COLUMNS:
            by_world.setdefault(_world(recipe, column), []).append((recipe, column))
    for world, cells in sorted(by_world.items()):
        if world == 1:
            results = _worker(0, 1, cells, corpus, tmp / "w1", hf_dirs)
        else:
            results = run_distributed(_worker, world, args=(cells, corpus, tmp / f"w{world}", hf_dirs), timeout=1200)[0]
        for (recipe, column), status in results.items():
            grid[recipe][column] = status
    for recipe in RECIPES:  # the second half of "resume at another world size": on one rank
        column = RESHARD
        if grid[recipe][column] == OK:
            where = tmp / "w2" / f"{recipe}-{column}".replace(" ", "_").replace("/", "_")
            grid[recipe][column] = _resume_on_one(recipe, corpus, where)
    return grid


def _resume_on_one(recipe: str, corpus, where: Path) -> str:
    batch = str(2 * int(TINY_OVERRIDES["data.batch_size"]))  # (the global batch of the 2 ranks)
    over = {**RECIPES[recipe], "dist.mode": "fsdp", "train.steps": "4", "data.batch_size": batch}
    return _status(lambda: _fit(corpus, where / "run", over, resume=True), where)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers import make_hf_model

    root = tmp_path_factory.mktemp("grid-hf")
    for name in FAMILIES:
        make_hf_model(root / name, family=name.lower())
    return {name: root / name for name in FAMILIES}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_grid_is_the_committed_one(corpus, tmp_path, hf_dirs, request):
    grid = compute(corpus, tmp_path, hf_dirs)
    out = request.config.getoption("--grid-out")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        command = f"python -m pytest tests/test_grid.py --grid-out {Path(out).resolve().relative_to(RESULTS.parents[2])}"
        Path(out).write_text(json.dumps({"command": command, "columns": list(COLUMNS), "grid": grid}, indent=1,
                                        ensure_ascii=False) + "\n")
        return
    files = sorted(RESULTS.glob("*_cpu.json"))
    assert files, f"no committed grid in {RESULTS}; write one with --grid-out"
    committed = json.loads(files[-1].read_text())["grid"]
    differ = {(r, c): (committed.get(r, {}).get(c), s) for r, row in grid.items() for c, s in row.items()
              if committed.get(r, {}).get(c) != s}
    assert not differ, f"cells differ from {files[-1].name} (committed, now): {differ}"
