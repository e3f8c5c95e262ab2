"""Host time of one forward with AGoQ's save path, variant by variant, on the real model.

    PYTHONPATH=src python3 benchmarks/agoq_host_gpu.py --out DIR             # GPU: 1b, B = 8, T = 1024, bf16
    PYTHONPATH=src python3 benchmarks/agoq_host_gpu.py --out DIR --tiny      # any machine: 1b structure, tiny widths

Each forward starts on an idle device (synchronized before) and is timed twice: the host time
to issue it, and the wall time until the device finished it. A forward is host-bound when the
two are close. Variants: no hooks; identity saved-tensor hooks; AGoQ applied (replay, as the
trainer runs it); AGoQ without replay; AGoQ with larger batches (fewer flushes); derive off; AGoQ with the
quantize kernel's launch stubbed (the host cost of the rest); AGoQ with each batch's whole
quantize call stubbed (the host cost of the hooks alone). Stubbed variants make no backward.
Writes ``agoq_host_<device>.json`` into ``--out``; prints one line per variant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny widths (dim 64, 8 tokens): Python and dispatch only")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--quick", action="store_true",
                    help="only: no hooks, AGoQ (replay), AGoQ with the quantize call stubbed")
    ap.add_argument("--cprofile", action="store_true",
                    help="also cProfile 8 replayed forwards (host time by function): cprofile_agoq_forward.txt")
    a = ap.parse_args(argv)
    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama

    H = importlib.import_module("leantrain.agoq.hooks")
    P = importlib.import_module("leantrain.agoq.pack")
    M = importlib.import_module("leantrain.ops.multi")
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = preset("1b").model
    B, T = (8, 1024) if not a.tiny else (1, 8)
    if a.tiny:
        cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size = 64, 4, 2, 128, 256
        if not cuda:  # batches through the interpreter's host path, launch stubbed
            os.environ["TRITON_INTERPRET"] = "1"
            H.Packer.batch_devices, H.Packer.batch_backend = ("cpu",), "triton"
            M.launch = lambda *args, **kw: None
    else:
        cfg.vocab_size = 32000
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(cfg).to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (B, T + 1), device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(backward=True) -> dict:
        host, wall = [], []
        for i in range(3 + a.reps):
            sync()
            t0 = time.perf_counter()
            loss = model(idx[:, :-1], idx[:, 1:])
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if backward:
                loss.backward()
                for p in model.parameters():
                    p.grad = None
            del loss
            sync()
            if i >= 3:
                host.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
        return {"host_ms_min": min(host), "host_ms_median": statistics.median(host),
                "wall_ms_median": statistics.median(wall), "host_ms_all": host}

    rows = {}

    quick = {"no hooks", "agoq apply (replay)", "agoq replay, quantize call stubbed"}

    def run(name, setup=None, undo=None, backward=True):
        if a.quick and name not in quick:
            return
        if setup:
            setup()
        try:
            r = measure(backward)
        finally:
            if undo:
                undo()
        pk = getattr(model, "_agoq_packer", None)
        if pk is not None:
            r["stats"] = {k: v for k, v in pk.stats.items() if k in ("saved", "packed", "replay:diverged")}
            lt.agoq.remove(model)
        rows[name] = r
        print(f"{name:34s} host {r['host_ms_median']:7.2f} ms (min {r['host_ms_min']:7.2f})"
              f"  wall {r['wall_ms_median']:7.2f} ms  {r.get('stats', '')}", flush=True)

    ident = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    run("no hooks")
    run("identity saved-tensor hooks", ident.__enter__, lambda: ident.__exit__(None, None, None))
    run("agoq apply (replay)", lambda: lt.agoq.apply(model, lt.agoq.Policy()))
    run("agoq apply, no replay", lambda: lt.agoq.apply(model, lt.agoq.Policy(), replay=False))
    run("agoq replay, batch_mib=1024", lambda: lt.agoq.apply(model, lt.agoq.Policy(batch_mib=1024)))
    run("agoq replay, derive off", lambda: lt.agoq.apply(model, lt.agoq.Policy(derive="")))
    launch = M.launch
    M.launch = lambda *args, **kw: None
    run("agoq replay, quantize launch stubbed", lambda: lt.agoq.apply(model, lt.agoq.Policy()),
        backward=False)
    M.launch = launch
    flush = P.PackBatch.flush
    P.PackBatch.flush = lambda self: setattr(self, "_todo", [])
    run("agoq replay, quantize call stubbed", lambda: lt.agoq.apply(model, lt.agoq.Policy()), backward=False)
    P.PackBatch.flush = flush
    os.makedirs(a.out, exist_ok=True)
    if a.cprofile:  # where a replayed forward's host time goes
        import cProfile
        import io
        import pstats

        lt.agoq.apply(model, lt.agoq.Policy())
        measure(backward=True)
        prof = cProfile.Profile()
        for _ in range(8):
            sync()
            prof.enable()
            loss = model(idx[:, :-1], idx[:, 1:])
            prof.disable()
            loss.backward()
            for p in model.parameters():
                p.grad = None
            del loss
        lt.agoq.remove(model)
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(35)
        with open(os.path.join(a.out, "cprofile_agoq_forward.txt"), "w") as f:
            f.write("8 replayed AGoQ forwards (1b, B = 8, T = 1024), host time by function\n")
            f.write(buf.getvalue().replace(os.path.dirname(torch.__file__.rsplit("/torch/", 1)[0] + "/"), "<site>"))
    dname = torch.cuda.get_device_name(0) if cuda else "cpu-tiny"
    tag = "".join(c if c.isalnum() else "-" for c in dname)[:40]
    doc = {"device": dname, "torch": torch.__version__, "B": B, "T": T, "tiny": a.tiny, "rows": rows,
           "command": "PYTHONPATH=src python3 benchmarks/agoq_host_gpu.py " + " ".join(argv or sys.argv[1:])}
    with open(os.path.join(a.out, f"agoq_host_{tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
