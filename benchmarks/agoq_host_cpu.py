"""Host time AGoQ adds to a forward, on the CPU, with the kernels stubbed out.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/agoq_host_cpu.py

The 1b preset's layer structure (22 layers, the same modules and saved tensors: ~940 saves a
forward, 334 of them packed) at tiny widths (dim 64, 8 tokens), so every op is a few µs and
what is measured is Python and dispatch: the host work that makes AGoQ's forward host-bound on
the GPU machine. ``quantize_many`` is replaced by a stub that only builds the QTensors. Each
number is the minimum over 60 forwards (robust to a noisy machine). Prints one line per setup:
plain; identity saved-tensor hooks; the role module hooks alone; the full packer (batched).
Caveat: the packer frees the tensors it held at its flush inside the timed forward, where
with identity hooks autograd frees them later, outside it.

``--real-multi``: the real ``quantize_many`` host path (table, allocations, QTensors) with only
its kernel launch stubbed (``TRITON_INTERPRET=1``, the batch backend forced to "triton"),
instead of the stub that only builds the QTensors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-multi", action="store_true", help="the real quantize_many host path, launch stubbed")
    a = ap.parse_args(argv)
    if a.real_multi:
        os.environ["TRITON_INTERPRET"] = "1"
    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama
    from leantrain.ops import QTensor

    P = importlib.import_module("leantrain.agoq.pack")  # the package attribute is the function
    H = importlib.import_module("leantrain.agoq.hooks")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = preset("1b").model
    cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size = 64, 4, 2, 128, 256
    model = Llama(cfg)

    def stub(xs, bits=8, group_size=128, symmetric=True, **_):
        widths = bits if isinstance(bits, list) else [bits] * len(xs)
        return [QTensor(torch.empty(0, dtype=torch.uint8), torch.empty(0), None, x.shape, x.dtype, b, group_size,
                        symmetric) for x, b in zip(xs, widths)]

    if a.real_multi:
        M = importlib.import_module("leantrain.ops.multi")
        M.launch = lambda *args, **meta: None
        H.Packer.batch_backend = "triton"
    else:
        P.quantize_many = stub
    H.Packer.batch_devices = ("cpu",)
    idx = torch.randint(0, 256, (1, 9))

    def forward_ms(ctx=None, n=60) -> float:
        ts = []
        for i in range(n + 5):
            t = time.perf_counter()
            if ctx is None:
                loss = model(idx[:, :-1], idx[:, 1:])
            else:
                with ctx():
                    loss = model(idx[:, :-1], idx[:, 1:])
            dt = time.perf_counter() - t
            del loss
            if i >= 5:
                ts.append(dt)
        return min(ts) * 1e3

    def identity():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    print(f"plain                        {forward_ms():6.2f} ms")
    print(f"identity saved-tensor hooks  {forward_ms(identity):6.2f} ms")
    pk = H.Packer(model, lt.agoq.Policy(min_numel=0))
    pk.install()
    print(f"role module hooks only       {forward_ms():6.2f} ms")
    print(f"full packer                  {forward_ms(lambda: pk):6.2f} ms")
    print(f"saves per forward: {pk.stats['saved'] // 65}, packed {pk.stats['packed'] // 65}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
