"""Throughput of SDP4Bit's compression path on one GPU, and the step time it saves.

    PYTHONPATH=src python3 benchmarks/bench_comm.py --out DIR   [--preset 1b] [--nodes 2 --gpus-per-node 8]

What one GPU of an ``nodes x gpus_per_node`` job computes per step for a model of N
parameters (the preset's Llama, counted on the meta device; N ~ 1.1e9 for ``1b``), each
timed on the real sizes with the library's own calls (``SDP4Bit``'s kernels: Triton on
CUDA, torch elsewhere):

- ``grad.encode``   swizzle + Hadamard(32) + 8-bit quantize (group 512) + pack of N fp32 gradients
- ``grad.reduce``   unpack + fp32 sum of ``gpus_per_node`` peers' 8-bit chunks (N codes in all)
                    + 4-bit requantize (group 128)
- ``grad.decode``   unpack + sum of ``nodes`` peers' 4-bit chunks + inverse Hadamard (N / world)
- ``weight.encode`` difference master - bf16 weights, 4-bit quantize (group 2048) of N / world
- ``weight.decode`` unpack N 4-bit codes + add to the bf16 weights (all ranks' shards)

Each is reported as time and as effective bandwidth (bytes read + written / time), beside a
device-to-device copy of the N fp32 gradients measured in the same run. The estimated step
communication time (alpha-beta model, ``lt.comm.estimate_time``) compares a bf16
reduce-scatter + all-gather (Megatron's distributed optimizer with bf16 gradients) with
SDP4Bit (bytes from ``lt.comm.bytes_per_element``, plus the measured compression time, not
overlapped: an upper bound on SDP4Bit's time). Writes ``bench_comm.json`` and ``bench_comm.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from leantrain.comm import SDP4Bit, bytes_per_element, estimate_time  # noqa: E402
from leantrain.comm._kernels import QTensor, dequant_sum_requant, dequantize, quantize  # noqa: E402


def count_params(preset: str) -> int:
    from leantrain.config import preset as get_preset
    from leantrain.model import Llama

    cfg = get_preset(preset)
    cfg.model.vocab_size = cfg.data.tokenizer_vocab
    with torch.device("meta"):
        model = Llama(cfg.model)
    return sum(p.numel() for p in model.parameters())


def timeit(fn, *, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of ``fn()``."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def run(n_params: int, nodes: int, gpn: int, device: str, reps: int) -> dict:
    world = nodes * gpn
    comp = SDP4Bit()
    A = comp.alignment(None)
    S = -(-n_params // (world * A)) * A  # padded shard
    N = world * S
    (b1, b2), (g1, g2) = comp.grad_bits, comp.grad_groups
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(N, device=device, generator=gen)
    ops = {}

    # copy bandwidth of the same fp32 buffer
    buf = torch.empty_like(grad)
    t = timeit(lambda: buf.copy_(grad), reps=reps)
    ops["copy fp32"] = (t, 8 * N)

    # hop 1: swizzle [nodes, gpn, S] -> [gpn, nodes, S], Hadamard, 8-bit, pack
    def encode():
        xs = grad.view(nodes, gpn, S).transpose(0, 1).contiguous().view(-1)
        return comp._encode(xs, b1, g1, seed=1)

    q1 = encode()
    ops["grad.encode"] = (timeit(encode, reps=reps), 4 * N + 4 * N + 4 * N + N * b1 // 8 + 4 * N // g1)
    # hop 2: what arrives is gpn peers' chunks of nodes*S elements: N codes in all
    qin = QTensor.from_buffers(q1.data, q1.scale, shape=(nodes * S,), bits=b1, group_size=g1)
    red = lambda: dequant_sum_requant(qin, bits_out=b2, group_size_out=g2, stochastic=True, seed=2)  # noqa: E731
    q2 = red()
    ops["grad.reduce"] = (timeit(red, reps=reps), N * b1 // 8 + 4 * N // g1 + (N // gpn) * b2 // 8 + 4 * (N // gpn) // g2)
    # hop 3: nodes peers' 4-bit chunks of S elements
    per = S * b2 // 8
    d3, s3 = q2.data[: nodes * per], q2.scale[: nodes * (S // g2)]
    dec = lambda: comp._decode_sum(d3, s3, S, b2, g2)  # noqa: E731
    ops["grad.decode"] = (timeit(dec, reps=reps), nodes * (per + 4 * S // g2) + 4 * S)
    # weights: encode my shard's difference, decode everyone's
    master = torch.randn(S, device=device, generator=gen)
    wts = (grad * 0.01).to(torch.bfloat16)  # the bf16 model weights (N)

    def wenc():
        diff = master - wts[:S].float()
        return quantize(diff, bits=comp.weight_bits, group_size=comp.weight_group, stochastic=True, seed=3)

    qw = wenc()
    ops["weight.encode"] = (timeit(wenc, reps=reps), 4 * S + 2 * S + S // 2 + 4 * S // comp.weight_group)
    data = qw.data.repeat(world)
    scale = qw.scale.repeat(world)

    def wdec():
        qs = QTensor.from_buffers(data, scale, shape=(S,), bits=comp.weight_bits, group_size=comp.weight_group)
        d = dequantize(qs, dtype=torch.float32).view(-1)
        wts.copy_(wts.float() + d)

    ops["weight.decode"] = (timeit(wdec, reps=reps), N // 2 + 4 * N // comp.weight_group + 2 * N + 2 * N)
    if device == "cuda":
        torch.cuda.synchronize()

    rows = {k: {"seconds": t, "bytes": b, "GBps": b / t / 1e9} for k, (t, b) in ops.items()}
    copy_bw = rows["copy fp32"]["GBps"]
    for r in rows.values():
        r["vs_copy"] = r["GBps"] / copy_bw
    compute = sum(r["seconds"] for k, r in rows.items() if k != "copy fp32")

    # estimated communication per step, per GPU (buckets of 25 MiB of fp32 for the call counts)
    buckets = math.ceil(4 * n_params / (25 * 2**20))
    base_bytes = {"world": bytes_per_element("bf16", world=world, intra=gpn)["world"] * n_params}
    sdp_bytes = {k: v * n_params for k, v in bytes_per_element("sdp4bit", world=world, intra=gpn, compressor=comp).items()}
    base_calls = {"world": 2 * buckets}
    sdp_calls = {"intra": 2 * buckets, "inter": 2 * buckets, "world": 2 * buckets}  # data + scales
    est = {}
    for name, (inter_bw, intra_bw) in {"450/25": (25.0, 450.0)}.items():
        tb = estimate_time(base_bytes, intra_GBps=intra_bw, inter_GBps=inter_bw, calls_by_scope=base_calls, nodes=nodes)
        ts = estimate_time(sdp_bytes, intra_GBps=intra_bw, inter_GBps=inter_bw, calls_by_scope=sdp_calls, nodes=nodes)
        est[name] = {"bf16_rs_ag_s": tb["total"], "sdp4bit_comm_s": ts["total"], "sdp4bit_compute_s": compute,
                     "sdp4bit_total_s": ts["total"] + compute, "saving_s": tb["total"] - ts["total"] - compute,
                     "speedup": tb["total"] / (ts["total"] + compute), "sdp4bit_by_scope": ts, "bf16_by_scope": tb}
    return {"n_params": n_params, "padded": N, "world": world, "nodes": nodes, "gpus_per_node": gpn,
            "buckets": buckets, "ops": rows, "bytes_per_param": {"bf16": base_bytes["world"] / n_params,
                                                                 **{k: v / n_params for k, v in sdp_bytes.items()}},
            "estimate": est}


def to_markdown(res: dict, meta: dict) -> str:
    lines = [f"# bench_comm: SDP4Bit compression path ({meta['device_name']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; N = {res['n_params']:,} parameters "
             f"(preset {meta['preset']}), simulated {res['nodes']} nodes x {res['gpus_per_node']} GPUs.", "",
             "| operation (one GPU, per step) | ms | GB/s | vs copy |", "|---|---|---|---|"]
    for k, r in res["ops"].items():
        lines.append(f"| {k} | {r['seconds'] * 1e3:.2f} | {r['GBps']:.0f} | {r['vs_copy']:.2f} |")
    lines += ["", "| estimate per step, per GPU (450 GB/s intra, 25 GB/s inter, 10 us/call) | ms |", "|---|---|"]
    e = res["estimate"]["450/25"]
    lines += [f"| bf16 reduce-scatter + all-gather | {e['bf16_rs_ag_s'] * 1e3:.1f} |",
              f"| SDP4Bit communication | {e['sdp4bit_comm_s'] * 1e3:.1f} |",
              f"| SDP4Bit compression compute (measured above, not overlapped) | {e['sdp4bit_compute_s'] * 1e3:.1f} |",
              f"| saving | {e['saving_s'] * 1e3:.1f} ({e['speedup']:.2f}x faster communication) |", ""]
    b = res["bytes_per_param"]
    lines.append("Bytes sent per parameter and step, per GPU: bf16 " + f"{b['bf16']:.3f}; SDP4Bit intra "
                 f"{b['intra']:.3f}, inter {b['inter']:.4f}, world (weights) {b['world']:.3f}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for <date>_<hardware>_sdp4bit.json and .md")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--params", type=int, default=None, help="override the parameter count (e.g. small CPU runs)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.params or count_params(args.preset)
    if device == "cpu" and args.params is None:
        n = min(n, 1 << 22)  # the full 1.1e9 needs a GPU; keep CPU runs short
    res = run(n, args.nodes, args.gpus_per_node, device, args.reps)
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    meta = {"date": datetime.date.today().isoformat(), "device": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": tv,
            "preset": args.preset if n == count_params(args.preset) else f"{args.preset}, capped to {n:,}"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, harness.stem("sdp4bit") + ".json"), "w") as f:
        json.dump({"meta": meta, **res}, f, indent=2)
    md = to_markdown(res, meta)
    with open(os.path.join(args.out, harness.stem("sdp4bit") + ".md"), "w") as f:
        f.write(md)
    print(md)
    return res


def dispatch(argv: list[str]) -> int:
    """``gift`` and ``gift-cost`` run GIFT's benchmarks (``parts/gift.py``, ``parts/gift_cost.py``),
    ``scape-cost`` SCAPE's compute (``parts/scape_cost.py``); anything else is SDP4Bit's (``main``)."""
    if argv and argv[0] == "gift":
        from parts.gift import main as gift

        return gift(argv[1:])
    if argv and argv[0] == "gift-cost":
        from parts.gift_cost import main as gift_cost

        return gift_cost(argv[1:])
    if argv and argv[0] == "scape-cost":
        from parts.scape_cost import main as scape_cost

        return scape_cost(argv[1:])
    main(argv[1:] if argv and argv[0] == "sdp4bit" else argv)
    return 0


if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
