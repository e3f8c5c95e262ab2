"""ShardedOptimizer (+ SDP4Bit), FORGE data parallel (+ AGoQ) and the 8-bit all-reduce DDP hook
under torchrun on GPUs with NCCL: the same code as the gloo tests.

    torchrun --nproc-per-node 2 tests/dist/torchrun_smoke.py        (PYTHONPATH=src)
    LT_SMOKE_BACKEND=gloo torchrun --nproc-per-node 2 ...            (gloo on CUDA tensors: several
                                                                      ranks may share one GPU)

Checks, on every rank: without compression, weights equal DDP-averaged gradients + the
reference optimizer (fp32, TF32 off) to 1e-5 relative; with SDP4Bit (each of the node layouts
the GPU count allows), every rank holds bit-identical weights after each step and the loss
goes down; bf16 model weights work. FORGE (compiled Triton update, per-layer NCCL all-reduce of
dW inside backward) on each rank's half of the batch equals FORGE in one process on the whole
batch, in fp32 to 1e-4 relative, and with AGoQ on top every rank holds identical weights and the
loss falls; DDP with ``int8_allreduce_hook`` keeps ranks identical, learns like the fp32
all-reduce and sends <= 0.52x the bf16 bytes (the ledger's count). Prints one line per check
and exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import leantrain as lt  # noqa: E402
from leantrain.config import ModelConfig  # noqa: E402
from leantrain.model import Llama  # noqa: E402

CFG = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)


def batch(step, rank, dev):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, CFG.vocab_size, (4, 32), generator=g)
    return x.to(dev), x.roll(-1, 1).to(dev)


def flat(m):
    return torch.cat([p.detach().reshape(-1).float() for p in m.parameters()])


def identical(w):
    ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(ws, w)
    return all(torch.equal(ws[0], v) for v in ws)


def fit_fixed_batch(model, opt, x, y, steps=30):
    """``steps`` steps on one batch: (weights identical on every rank after each step, losses)."""
    same, losses = True, []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        same &= identical(flat(model))
        losses.append(loss.item())
    return same, losses


def main() -> int:
    dist.init_process_group(os.environ.get("LT_SMOKE_BACKEND", "nccl"))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ok = True

    def report(name, cond, extra=""):
        nonlocal ok
        ok &= bool(cond)
        if rank == 0:
            print(f"[{'PASS' if cond else 'FAIL'}] {name} {extra}", flush=True)

    # 1. uncompressed == DDP + reference
    torch.manual_seed(0)
    model, ref = Llama(CFG).to(dev), Llama(CFG).to(dev)
    ref.load_state_dict(model.state_dict())
    opt = lt.dist.ShardedOptimizer(model, lt.optim.AdamW(lr=1e-3, weight_decay=0.1), bucket_mb=0.1)
    ropt = lt.optim.Optimizer(ref.parameters(), lt.optim.AdamW(lr=1e-3, weight_decay=0.1))
    for s in range(4):
        x, y = batch(s, rank, dev)
        model(x, y).backward()
        ref(x, y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    a, b = flat(model), flat(ref)
    rel = float((a - b).abs().max() / b.abs().max())
    report("plain == DDP + reference", rel <= 1e-5, f"rel={rel:.2e} buckets={len(opt.buckets)}")
    report("plain identical weights", identical(a))

    # 2. SDP4Bit, every node layout this world allows, fp32 and bf16 weights
    layouts = sorted({1, world} | ({world // 2} if world % 2 == 0 and world > 2 else set()))
    for intra in layouts:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = Llama(CFG).to(dev, dtype)
            opt = lt.dist.ShardedOptimizer(model, lt.optim.AdamW(lr=3e-3), intra_node_size=intra,
                                           compression=lt.comm.SDP4Bit(pipeline=2), bucket_mb=0.2)
            x, y = batch(0, rank, dev)  # one fixed batch: the loss must fall
            with lt.runtime.ledger.COMM.capture() as led:
                same, losses = fit_fixed_batch(model, opt, x, y)
            report(f"sdp4bit intra={intra} {dtype}", same and losses[-1] < 0.7 * losses[0],
                   f"identical={same} loss {losses[0]:.3f}->{losses[-1]:.3f} bytes={led.by_scope()}")
    # 3. FORGE data parallel (per-layer all-reduce inside backward) == FORGE on the whole batch
    torch.manual_seed(0)
    model, ref = Llama(CFG).to(dev), Llama(CFG).to(dev)
    ref.load_state_dict(model.state_dict())
    rule = lt.optim.AdamW(lr=1e-3, weight_decay=0.1)
    opt = lt.forge.attach(model, rule)
    ropt = lt.forge.attach(ref, rule, dp_group=False)
    for s in range(3):
        x, y = batch(s, rank, dev)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        xs, ys = zip(*(batch(s, r, dev) for r in range(world)))  # every rank's batch: the global one
        ref(torch.cat(xs), torch.cat(ys)).backward()
        ropt.step()
        ropt.zero_grad()
    a, b = flat(model), flat(ref)
    rel = float((a - b).abs().max() / b.abs().max())
    report("forge data parallel == one process on the global batch", rel <= 1e-4 and identical(a),
           f"rel={rel:.2e} fused layers={len(opt.layers)}")
    lt.forge.detach(model)
    lt.forge.detach(ref)

    # 4. FORGE (bf16 + SR, int8 states) + AGoQ, data parallel: ranks in sync, the loss falls
    torch.manual_seed(0)
    model = Llama(CFG).to(dev, torch.bfloat16)
    opt = lt.forge.attach(model, lt.optim.AdamW(lr=3e-3), state_dtype="int8", stochastic_rounding=True)
    lt.agoq.apply(model, lt.agoq.Policy())
    same, losses = fit_fixed_batch(model, opt, *batch(0, rank, dev))
    report("forge (bf16 + SR, int8 states) + agoq data parallel", same and losses[-1] < 0.7 * losses[0],
           f"identical={same} loss {losses[0]:.3f}->{losses[-1]:.3f}")
    lt.agoq.remove(model)
    lt.forge.detach(model)

    # 5. DDP with the 8-bit all-reduce hook against the fp32 all-reduce
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = Llama(CFG).to(dev)
    runs = {}
    for name in ("fp32", "int8"):
        m = Llama(CFG).to(dev)
        m.load_state_dict(base.state_dict())
        ddp = DDP(m, device_ids=[dev.index], bucket_cap_mb=0.25)
        if name == "int8":
            ddp.register_comm_hook(lt.comm.Int8AllReduceState(), lt.comm.int8_allreduce_hook)
        o = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses = []
        with lt.runtime.ledger.COMM.capture() as led:
            for s in range(30):
                g = torch.Generator().manual_seed(100 * s + rank)  # next token = current + 1
                start = torch.randint(0, 200, (4, 1), generator=g)
                seq = ((start + torch.arange(33)) % CFG.vocab_size).to(dev)
                o.zero_grad(set_to_none=True)
                loss = ddp(seq[:, :-1], seq[:, 1:])
                loss.backward()
                o.step()
                losses.append(loss.item())
        runs[name] = (flat(m), losses, led.total)
    w8, l8, b8 = runs["int8"]
    l32 = runs["fp32"][1]
    # a ring all-reduce of the bf16 gradients, counted as the ledger counts one (2 (n-1) / n of them)
    nbf16 = 2 * (world - 1) * 2 * sum(p.numel() for p in base.parameters()) // world * 30
    late8, late32 = sum(l8[-5:]) / 5, sum(l32[-5:]) / 5
    report("ddp + int8_allreduce_hook", identical(w8) and late8 < 0.7 * sum(l8[:5]) / 5
           and abs(late8 - late32) / late32 < 0.05 and b8 <= 0.52 * nbf16,
           f"loss {l8[0]:.3f}->{late8:.3f} (fp32 hook {late32:.3f}); bytes sent {b8} = {b8 / nbf16:.3f}x bf16")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
