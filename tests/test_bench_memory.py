"""benchmarks/bench_memory.py keeps running: a few configurations of the whole-step benchmark on
CPU at the tiny preset (each in its own process, as on the GPU), and its 8-bit AdamW
(benchmarks/parts/adamw8bit.py) against torch's AdamW."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_memory_under_test", BENCH / "bench_memory.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_configs_run_on_cpu(tmp_path):
    bench = _load()
    configs = ["torchtune_recipe", "chunkft8"]
    assert bench.main(["--presets", "tiny", "--vocab", "512", "--batches", "1", "--seqs", "32", "--steps", "2", "--warmup", "0",
                       "--device", "cpu", "--configs", *configs, "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*_memory.json")
    res = json.loads(path.read_text())
    assert [r["config"] for r in res["rows"]] == configs
    for r in res["rows"]:
        assert r["status"] == "ok", (r["config"], r.get("error"))
        assert math.isfinite(r["final_loss"]) and r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert r["weight_bytes"] > 0 and r["state_bytes"] > 0 and r["peak_bytes"] is None  # (CPU: no allocator peak)
    by = {r["config"]: r for r in res["rows"]}
    # 8-bit m and v and a 4-byte scale a block of 256: about the bf16 weights' bytes (torch's bf16 AdamW: twice)
    assert by["torchtune_recipe"]["state_bytes"] < 1.1 * by["torchtune_recipe"]["weight_bytes"]
    # ChunkFT: one chunk's fp32 state of 8 on the device, every chunk's in host memory
    assert 0 < by["chunkft8"]["state_bytes"] < by["chunkft8"]["host_state_bytes"]
    md = path.with_suffix(".md").read_text()
    assert "## tiny, vocabulary 512, T = 32" in md and all(f"| {c} |" in md for c in configs)


def test_the_profile_names_where_the_host_calls_come_from(tmp_path):
    """``--profile``: the step's operators by call count, each with the leantrain frames that called it."""
    bench = _load()
    assert bench.main(["--presets", "tiny", "--vocab", "512", "--batches", "1", "--seqs", "32", "--steps", "1",
                       "--warmup", "0", "--device", "cpu", "--configs", "forge_int8_states", "--profile",
                       "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*_memory.json")
    [row] = json.loads(path.read_text())["rows"]
    calls = row["profile"]["host_calls"]
    assert calls and all(c["op"].startswith("aten::") and c["calls_per_step"] > 0 for c in calls)
    assert [c["calls_per_step"] for c in calls] == sorted((c["calls_per_step"] for c in calls), reverse=True)
    # FORGE's int8 states on CPU run the torch reference of the codec: its calls are attributed to it
    assert any(any("leantrain/ops/state8.py" in f for f in c["stack"]) for c in calls)


def test_adamw8bit_follows_torch_adamw():
    """Five steps on a 67 x 130 weight (quantized: over 4096 elements, blocks of 256 with a partial
    last one) with gradients whose rows differ in scale: the 8-bit optimizer's displacement of the
    weight is within 5 % (norm) of torch's. The moments' dynamic 8-bit codes carry about 1 %
    relative error a step at the top of a block's range, more for values far below its absmax."""
    _load()
    from parts.adamw8bit import AdamW8bit

    torch.manual_seed(0)
    w0 = torch.randn(67, 130) * 0.02
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, opt_ref = AdamW8bit([ours], **hyper), torch.optim.AdamW([ref], **hyper)
    for _ in range(5):
        g = torch.randn_like(w0) * torch.rand(67, 1) * 3
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    moved, moved_ref = ours.detach() - w0, ref.detach() - w0
    assert (moved - moved_ref).norm() < 0.05 * moved_ref.norm()
    assert (moved - moved_ref).abs().max() < 0.15 * moved_ref.abs().max()
    state = sum(t.numel() * t.element_size() for t in opt.state_tensors())
    assert state == 2 * (w0.numel() + 4 * math.ceil(w0.numel() / 256))  # uint8 codes + an fp32 absmax a block
