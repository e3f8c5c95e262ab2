"""``leantrain finetune`` end to end on the generated tasks: a checkpoint of a short training run,
fine-tuned by each method through the trainer; the summary's figures come from the run (accuracy,
counted memory); bad input fails with a message."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_config
from leantrain.cli import main as cli_main
from leantrain.data import tasks
from leantrain.runtime import checkpoint
from leantrain.train.trainer import Trainer

QUIET = ["--train.progress", "false"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("pre") / "run"
    Trainer(tiny_config(corpus, **{"train.steps": "5"}), out).fit()
    return out


@pytest.mark.parametrize("method", ["mezo", "grzo", "chunkft", "full", "forge"])
def test_finetune_from_a_run(trained, tmp_path, method):
    out = tmp_path / method
    rc = cli_main(["finetune", "--method", method, "--task", "lookup", "--from", str(trained), "--steps", "4",
                   "--data.batch-size", "4", "--finetune.eval-examples", "32", "--out", str(out), *QUIET])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["init_from"] == str(trained) and cfg["finetune"]["task"] == "lookup"
    assert (out / "tokenizer.json").read_text() == (trained / "tokenizer.json").read_text()  # the run's own
    assert 0.0 <= s["val_accuracy"] <= 1.0 and s["val_loss"] > 0 and s["initial_val_accuracy"] is not None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and "val_accuracy" in lines[-1]
    mem, weights = s["memory"], s["memory"]["weights"]
    if method in ("full", "forge"):
        assert s["recipe"] == ("forge" if method == "forge" else "reference-adamw")
        assert mem["optimizer_states"] >= 2 * weights  # AdamW's two fp32 states
    elif method == "chunkft":  # a quarter of the gradients and states on the device (4 chunks); the rest in host memory
        assert s["num_chunks"] == 4 and s["interval"] == 1
        assert 0.6 * weights < s["method_bytes"] < 0.9 * weights
        assert s["offloaded_bytes"] == 2 * weights
    else:  # zeroth order: no gradient, no state; a noise block (and GRZO's int8 signs), far below the weights
        assert mem["grads"] == 0 and mem["optimizer_states"] == 0
        assert 0 < s["method_bytes"] < 0.5 * weights
    if method == "grzo":
        assert s["grzo_frozen"] == ["embed_tokens.weight"]
    # the fine-tuned weights are kept: a second run from the output starts where this one ended
    again = tmp_path / (method + "2")
    assert cli_main(["finetune", "--method", "full", "--optim.lr", "1e-12", "--task", "lookup", "--from", str(out),
                     "--steps", "1", "--data.batch-size", "2", "--finetune.eval-examples", "32", "--out", str(again),
                     *QUIET]) == 0
    s2 = json.loads((again / "summary.json").read_text())
    assert s2["initial_val_accuracy"] == s["val_accuracy"]
    assert s2["initial_val_loss"] == pytest.approx(s["val_loss"], rel=1e-6)


def test_chunkft_stepping_inside_backward(trained, tmp_path):
    """``--method chunkft --forge``: the working set stepped inside backward, bf16 chunk state: no
    gradient rows held, half the state bytes in host memory, and it learns as ChunkFT does."""
    runs = {}
    for name, extra in (("plain", []), ("forge", ["--forge", "--finetune.chunk-state-dtype", "bf16"])):
        out = tmp_path / name
        assert cli_main(["finetune", "--method", "chunkft", "--task", "lookup", "--from", str(trained), "--steps", "8",
                         "--data.batch-size", "4", "--finetune.eval-examples", "32", "--out", str(out), *QUIET,
                         *extra]) == 0
        runs[name] = json.loads((out / "summary.json").read_text())
    plain, fused = runs["plain"], runs["forge"]
    weights = fused["memory"]["weights"]
    assert fused["recipe"] == "chunkft+forge" and fused["in_backward"] and fused["chunk_state_dtype"] == "bf16"
    assert fused["offloaded_bytes"] == weights  # (two bf16 states of every fp32 weight)
    # the state arena at half the bytes and no gradient rows (their exact count: test_chunkft_backward)
    assert fused["method_bytes"] < 0.7 * plain["method_bytes"]
    assert fused["val_loss"] < fused["initial_val_loss"]
    assert fused["val_loss"] == pytest.approx(plain["val_loss"], rel=0.05)


def test_finetune_errors(trained, tmp_path, capsys):
    base = ["finetune", "--from", str(trained), "--out", str(tmp_path / "x"), "--task", "lookup"]
    assert cli_main(base + ["--method", "grzo", "--data.batch-size", "1"]) == 2
    assert "data.batch_size >= 2" in capsys.readouterr().err
    assert cli_main(base + ["--method", "mezo", "--data.grad-accum", "2"]) == 2
    assert "data.grad_accum 1" in capsys.readouterr().err
    assert cli_main(base + ["--method", "chunkft", "--forge", "--forge.state-dtype", "int8"]) == 2
    assert "finetune.chunk_state_dtype" in capsys.readouterr().err
    assert cli_main(base + ["--method", "sgd"]) == 2
    assert "--method must be one of" in capsys.readouterr().err
    assert cli_main(["finetune", "--from", str(trained), "--out", str(tmp_path / "y")]) == 2
    assert "--data FILE" in capsys.readouterr().err
    assert cli_main(["finetune", "--method", "mezo", "--task", "lookup", "--from", str(tmp_path / "nothing"),
                     "--out", str(tmp_path / "z")]) == 2
    assert "nothing" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_finetune_random_weights_with_overrides(corpus, tmp_path):
    """Without --from: the preset's model, changed by --section.field overrides, the corpus's tokenizer."""
    out = tmp_path / "r"
    args = ["finetune", "--method", "grzo", "--task", "compare", "--steps", "2", "--data.batch-size", "4",
            "--finetune.eval-examples", "8", "--out", str(out), "--model.n-layers", "1", "--model.dim", "32",
            "--model.n-heads", "2", "--model.n-kv-heads", "1", "--model.ffn-dim", "64", "--data.path", str(corpus),
            "--data.tokenizer-vocab", "400", *QUIET]  # (the task encoded with the corpus's BPE)
    assert cli_main(args) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["n_layers"] == 1 and cfg["train"]["init_from"] is None and cfg["model"]["vocab_size"] == 400
    with pytest.raises(ValueError, match="unknown task"):
        tasks.examples("sorting", 3, seed=0)


def test_tasks_are_deterministic_and_labelled():
    for name in tasks.TASKS:
        a, b = tasks.examples(name, 50, seed=1), tasks.examples(name, 50, seed=1)
        assert a == b and a != tasks.examples(name, 50, seed=2)
        for e in a:
            assert 0 <= e.label < len(e.candidates) and len(set(e.candidates)) == len(e.candidates)
    e = tasks.examples("compare", 1, seed=0)[0]
    digits = [int(c) for c in e.candidates]
    assert digits[e.label] == max(digits)
    e = tasks.examples("parity", 1, seed=0)[0]
    bits = [int(c) for c in e.prompt.split("[")[1].split("]")[0].split(", ")]
    assert e.candidates[e.label] == f"{sum(bits) % 2}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method,mode", [("grzo", "fsdp"), ("mezo", "ddp")])
def test_torchrun_two_ranks_match_one_process(trained, tmp_path, method, mode):
    """2 gloo ranks of --batch-size 2 fine-tune like one process of --batch-size 4: the same weights.
    (Under ``--dist.mode fsdp`` the weights are a DCP checkpoint; that FSDP's run is DDP's bit for bit,
    for both methods, is ``test_zo_fsdp``'s, in the trainer: one mode a method here covers the CLI.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import free_port

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    common = ["-m", "leantrain", "finetune", "--method", method, "--task", "lookup", "--from", str(trained),
              "--steps", "3", "--finetune.eval-examples", "16", "--optim.lr", "1e-3" if method == "mezo" else "1e-4",
              "--train.device", "cpu", *QUIET]  # (gloo: two ranks on a one-GPU machine could not share it through NCCL)
    one = subprocess.run([sys.executable, *common, "--data.batch-size", "4", "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), *common, "--data.batch-size", "2", "--dist.mode", mode, "--out",
                          str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    (w1, meta1), (w2, meta2) = (checkpoint.load_model_state(tmp_path / d / "checkpoints" / "step_0000003")
                                for d in ("one", "two"))
    assert (meta2.get("format") == checkpoint.DCP_FORMAT) == (mode == "fsdp")
    start, _ = checkpoint.load_model_state(checkpoint.latest(trained))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k].float() - start[k].float()).abs().max()) for k in w1) > 1e-5  # it moved
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-6)
    assert abs(s1["val_loss"] - s2["val_loss"]) < 1e-5


@pytest.mark.parametrize("method", ["mezo", "grzo", "chunkft", "chunkft+forge", "full"])
def test_resume_continues_bit_for_bit(trained, tmp_path, method):
    """4 steps straight (a checkpoint every 2) against 2 steps, then --resume to 4: the same weights, the
    metrics continued, the first evaluation kept; a checkpoint of another method is refused."""
    from safetensors.torch import load_file

    name, *forge = method.split("+")
    base = ["finetune", "--method", name, "--task", "lookup", "--from", str(trained), "--data.batch-size", "4",
            "--finetune.eval-examples", "16", "--finetune.num-chunks", "3", "--train.device", "cpu", *QUIET,
            *(["--forge", "--finetune.chunk-state-dtype", "bf16"] if forge else [])]
    assert cli_main([*base, "--steps", "4", "--train.ckpt-every", "2", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "checkpoints" / "step_0000002").is_dir()
    assert cli_main([*base, "--steps", "2", "--out", str(tmp_path / "b")]) == 0
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a step logged after the checkpoint, then lost
        f.write(json.dumps({"step": 3, "loss": 0.0, "lr": 0.0}) + "\n")
    assert cli_main([*base, "--steps", "4", "--resume", "--out", str(tmp_path / "b")]) == 0
    wa, wb = (load_file(str(tmp_path / d / "checkpoints" / "step_0000004" / "model.safetensors")) for d in "ab")
    assert wa.keys() == wb.keys()
    assert {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])} == {}
    lines = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert sb["val_accuracy"] == sa["val_accuracy"] and sb["val_loss"] == sa["val_loss"]
    other = "full" if name != "full" else "mezo"
    bad = [*base[:2], other, *base[3:]]
    assert cli_main([*bad, "--steps", "6", "--resume", "--out", str(tmp_path / "b")]) == 2


def test_mezo_default_lr_shrinks_with_the_parameter_count():
    from leantrain.cli import build_parser, finetune_config
    from leantrain.train.budget import parameter_count

    def lr(*argv):
        args, rest = build_parser().parse_known_args(["finetune", "--method", "mezo", "--task", "lookup", "--out", "unused", *argv])
        cfg = finetune_config(args, rest)
        return cfg.optim.lr, parameter_count(cfg)

    (tiny, n_tiny), (big, n_big) = lr("--preset", "tiny"), lr("--preset", "1b")
    assert n_big > 300 * n_tiny and abs(tiny - 3e-4) < 2e-5
    assert big * n_big == pytest.approx(tiny * n_tiny) and 5e-7 < big < 2e-6
    assert lr("--preset", "1b", "--optim.lr", "1e-3")[0] == 1e-3  # (given: kept)
