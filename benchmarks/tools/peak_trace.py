"""Where a training step's allocator peak happens: the CUDA allocator's peak per interval between
module boundaries, forward and backward.

    PYTHONPATH=src python3 benchmarks/tools/peak_trace.py --config agoq --out DIR     # 1b, B = 8, T = 1024, bf16
    PYTHONPATH=src python3 benchmarks/tools/peak_trace.py --config baseline --model fused_loss=false --out DIR

Forward: pre/post hooks on every module named with at most four levels (``layers.0.mlp.up_proj``:
blocks, attention, MLP, norms, linears, the LM head). Backward: a gradient hook on each such module's output fires when its backward
starts. At each event the allocator's allocated bytes and its peak since the previous event
are read, then the peak is reset. The step is forward + backward of the bf16 model (as
``bench_agoq.py``), after two untraced steps. Writes ``peak_trace_<config>.json`` (every
event) and prints the ten intervals with the highest peaks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE.parent))

from bench_agoq import _set_field  # noqa: E402


def main(argv=None) -> int:
    import torch

    from leantrain.agoq import Policy, apply
    from leantrain.config import preset
    from leantrain.model import Llama

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=("baseline", "agoq"), default="agoq")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("peak_trace.py reads the CUDA allocator: it needs a GPU")
    cfg = preset(args.preset)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.seq)
    cfg.model.vocab_size = cfg.data.tokenizer_vocab
    for kv in args.model:
        _set_field(cfg.model, kv)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Llama(cfg.model)
    m = m.to(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g).cuda()
    tgt = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g).cuda()
    if args.config == "agoq":
        policy = Policy()
        for kv in args.policy:
            _set_field(policy, kv)
        apply(m, policy)

    events: list[tuple[str, int, int]] = []
    on = [False]
    gib = 2**30

    def mark(label: str) -> None:
        if on[0]:
            events.append((label, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()

    def pre(name):
        return lambda mod, a: mark(f"fwd> {name}")

    def post(name):
        def hook(mod, a, out):
            mark(f"fwd< {name}")
            if on[0] and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: mark(f"bwd> {name}"))
        return hook

    for name, mod in m.named_modules():
        if name and name.count(".") < 4:
            mod.register_forward_pre_hook(pre(name))
            mod.register_forward_hook(post(name))

    def step(trace: bool):
        for p in m.parameters():
            p.grad = None
        torch.cuda.synchronize()
        on[0] = trace
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        mark("step start")
        loss = m(idx, tgt)
        mark("forward end (loss)")
        loss.backward()
        mark("backward end")
        torch.cuda.synchronize()
        on[0] = False
        return before

    step(False)
    step(False)
    before = step(True)
    # events[i] = (label, allocated at the event, peak in the interval that ends at it)
    rows = [{"event": lab, "allocated_gib": a / gib, "peak_before_gib": pk / gib,
             "peak_above_start_gib": (pk - before) / gib} for lab, a, pk in events]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.config + "".join("_" + kv.replace("=", "-") for kv in args.model + args.policy)
    (out / f"peak_trace_{tag}.json").write_text(json.dumps({"config": tag, "before_gib": before / gib, "rows": rows}))
    top = sorted(range(1, len(rows)), key=lambda i: -rows[i]["peak_before_gib"])[:10]
    print(f"{tag}: weights {before / gib:.3f} GiB; overall peak {max(r['peak_before_gib'] for r in rows):.3f} GiB")
    for i in sorted(top):
        print(f"  {rows[i - 1]['event']:>45} -> {rows[i]['event']:<45} peak {rows[i]['peak_before_gib']:.3f}"
              f" (allocated {rows[i - 1]['allocated_gib']:.3f} -> {rows[i]['allocated_gib']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
