"""FORGE's warp-specialized Gluon kernel (forge/ws.py).

CPU: the kernel compiles for sm_90 (each variant), with the schedule it is written for: three
partitions, asynchronous wgmma reading dY transposed from shared memory, TMA loads, register
reallocation, and a shared-memory footprint that fits an H200's SM. CUDA (an sm_90 GPU): the fused
update equals, bit for bit, the kernel's own dW (mode 1) followed by the update-only kernel of
ops/update.py, for every rule and fp32 / bf16 + SR weights; its dW is dYᵀX within fp32 summation error;
a tile with a non-finite gradient keeps its weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leantrain.forge import ws

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import forge_probes as probes  # noqa: E402  (the probes and self-test live with the benchmark tools)

needs_gluon = pytest.mark.skipif(not ws.HAVE_GLUON, reason="Triton without Gluon")


def _ptxas_ok() -> bool:
    import os

    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


# bf16 dW hand-over (DW16) with the rings its halved dW slot leaves room for
_DW16 = {"DW16": {"DW16": 1}, "DEEP16": {"DW16": 1, **ws.DEEP16_CONFIG}, "ROWS6416": {"DW16": 1, **ws.ROWS64_CONFIG},
         "PLAIN16": {"DW16": 1, **ws.PLAIN_CONFIG}, "GROUP16": {"GROUP_M": 16},
         "DEEP16G": {"DW16": 1, **ws.DEEP16_CONFIG, "GROUP_M": 8}}


def _config(name):
    return _DW16[name] if name in _DW16 else getattr(ws, name + "_CONFIG") if name else None


_COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import forge_probes as probes
from leantrain.forge import ws
dw16 = json.loads(sys.argv[1])
out = []
for mode, wdt, sdt, name, dyn in [(0, "fp32", "fp32", "", 0), (0, "bf16", "bf16", "", 1), (1, "fp32", "fp32", "", 0),
                                  (0, "fp32", "fp32", "PLAIN", 0), (2, "fp32", "fp32", "", 0), (0, "fp32", "fp32", "DEEP", 0),
                                  (0, "fp32", "fp32", "ROWS64", 0), (0, "fp32", "fp32", "DW16", 0),
                                  (1, "fp32", "fp32", "DW16", 0), (0, "bf16", "fp32", "DEEP16", 0),
                                  (0, "fp32", "fp32", "ROWS6416", 0), (0, "fp32", "fp32", "GROUP16", 0),
                                  (0, "bf16", "fp32", "DEEP16G", 0)]:
    cfg = dw16[name] if name in dw16 else getattr(ws, name + "_CONFIG") if name else None
    ck = probes.compile_sm90(mode, w_dtype=wdt, state_dtype=sdt, dyn=bool(dyn), config=cfg)
    ptx = ck.asm["ptx"]
    out.append({"mode": mode, "name": name, "elem": 4 if wdt == "fp32" else 2, "wgmma": ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"),
                "tma": "cp.async.bulk.tensor" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
                "st_global": "st.global" in ptx, "warps": ck.metadata.num_warps, "shared": ck.metadata.shared})
print(json.dumps(out))
"""


@needs_gluon
@pytest.mark.skipif(not ws.HAVE_GLUON or not _ptxas_ok(), reason="no ptxas in Triton's wheel")
def test_compiles_for_sm90_with_its_schedule():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled, not interpreted)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    tools = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools")
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(_DW16), tools], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for v in json.loads(r.stdout.strip().splitlines()[-1]):
        cfg = {**ws.WS_CONFIG, **(_config(v["name"]) or {})}
        # operand ring + the dW slot (bf16 with DW16)
        smem = cfg["STAGES"] * cfg["BT"] * (cfg["BM"] + cfg["BN"]) * 2 + cfg["BM"] * cfg["BN"] * (2 if cfg["DW16"] else 4)
        # BM / 64 warp-group MMAs (m64) a 16-token step, A transposed (dY read as stored, [T, N])
        assert v["wgmma"] == cfg["BM"] // 64 * cfg["BT"] // 16
        assert v["tma"] and v["setmaxnreg"]  # TMA loads; the partitions' register budgets
        assert v["warps"] == cfg["num_warps"] + 4 + 4  # update warps + the MMA group + the loader's group
        # the default (STATE_TMA, mode 0): a ring of slices of W, m, v in shared memory too
        tma_state = cfg["STATE_TMA"] and v["mode"] == 0
        extra = cfg["SSTAGES"] * cfg["SUB"] * cfg["BN"] * v["elem"] * 3 if tma_state else 0
        assert smem + extra <= v["shared"] <= 227 * 1024
        assert v["st_global"]


def test_the_state_ring_is_used_where_tma_can_load_w_and_the_states():
    aligned = torch.zeros(4, 8)
    unaligned = torch.zeros(33)[1:].view(4, 8)  # (4 bytes past an allocation's start)
    assert ws.resolve_config(None, 0, (aligned, aligned))["STATE_TMA"] == 1  # the default
    assert ws.resolve_config(None, 1, (aligned,))["STATE_TMA"] == 0  # mode 1 writes dW: no state to read
    assert ws.resolve_config(None, ws.PROBE_GEMM, (aligned,))["STATE_TMA"] == 0  # the GEMM probe: no state either
    assert ws.resolve_config(None, ws.PROBE_UPDATE, (aligned,))["STATE_TMA"] == 1  # the update probe reads it as mode 0 does
    plain = ws.resolve_config(None, 0, (aligned, unaligned))
    assert plain["STATE_TMA"] == 0 and plain["SUB"] == ws.PLAIN_CONFIG["SUB"]
    assert ws.resolve_config({"SUB": 8}, 0, (aligned,))["SUB"] == 8
    assert ws.WS_CONFIG["STATE_TMA"] == 1  # (not changed in place)


def test_auto_config_deepens_the_operand_ring_for_long_token_runs_and_halves_the_tail_below():
    assert ws.auto_config(2048, 5632, 2048, 132) == {**ws.DEEP_CONFIG, **ws.GROUPED_CONFIG}  # 44 block columns
    assert ws.auto_config(5632, 2048, 2048, 132) == ws.DEEP_CONFIG  # 16 block columns: 8 rows a wave
    assert ws.auto_config(2048, 5632, 2048, 132, dw_bf16=True) == {**ws.DEEP16_CONFIG, **ws.GROUPED_CONFIG}
    assert ws.auto_config(5632, 2048, 512, 132) == ws.ROWS64_CONFIG  # 704 tiles of 128 rows: 5.33 waves
    assert ws.auto_config(32000, 2048, 1024, 132) == {}  # 4000 tiles: 30.3 waves, the last nearly full
    assert ws.auto_config(2048, 2048, 512, 132) == {} and ws.auto_config(136, 264, 100, 132) == {}
    # a bf16 hand-over: the deep ring with a 2-slot state ring from T = 1024, the fp32 rule below
    assert ws.auto_config(2048, 5632, 1024, 132, dw_bf16=True) == ws.DEEP16_CONFIG  # (grouped from T = 2048)
    assert ws.auto_config(32000, 2048, 16384, 132, dw_bf16=True) == ws.DEEP16_CONFIG
    assert ws.auto_config(5632, 2048, 512, 132, dw_bf16=True) == ws.ROWS64_CONFIG
    assert ws.auto_config(2048, 5632, 1024, 132) == ws.ROWS64_CONFIG
    # (what they cost in shared memory: the H200 has 227 KiB; DEEP16's dW slot is bf16)
    for cfg in (ws.DEEP_CONFIG, ws.ROWS64_CONFIG, {**ws.DEEP16_CONFIG, "DW16": 1}):
        c = {**ws.WS_CONFIG, **cfg}
        smem = (c["STAGES"] * c["BT"] * (c["BM"] + c["BN"]) * 2 + c["BM"] * c["BN"] * (2 if c["DW16"] else 4)
                + c["SSTAGES"] * c["SUB"] * c["BN"] * 12)
        assert smem <= 227 * 1024


def test_balance_keeps_the_waves_and_evens_the_programs_out():
    assert ws._programs(704, 132, {}) == 132 and ws._programs(50, 132, {}) == 50
    assert ws._programs(704, 132, {"BALANCE": 1}) == 118  # 6 tiles a program (4 with 5), as 132 programs need
    assert ws._programs(4000, 132, {"BALANCE": 1}) == 130  # 31 waves either way
    assert ws._programs(264, 132, {"BALANCE": 1}) == 132 and ws._programs(704, 132, {"CTAS": 88}) == 88


gpu = pytest.mark.skipif(not ws.available(), reason="needs an sm_90 GPU and Gluon")


@gpu
@pytest.mark.parametrize("rule", ["adamw", "sgd", "nesterov", "lion", "adams"])
@pytest.mark.parametrize("wdt,sdt", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")])
@pytest.mark.parametrize("n,k,t", [(136, 264, 100), (512, 384, 1000)])
def test_fused_equals_its_dw_then_the_update_kernel(rule, wdt, sdt, n, k, t):
    r = probes.check(n, k, t, rule, wdt, sdt)
    assert r["dw_rel_err"] < 1e-5 and r["moved"] > 0
    assert r["bitwise"]


@gpu
@pytest.mark.parametrize("config", [ws.PLAIN_CONFIG, ws.DEEP_CONFIG, ws.ROWS64_CONFIG,
                                    {**ws.ROWS64_CONFIG, **ws.PLAIN_CONFIG}, {"BALANCE": 1, "CTAS": 2}])
@pytest.mark.parametrize("wdt,sdt", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")])
def test_the_other_read_schedules_give_the_same_bits(config, wdt, sdt):
    for rule in ("adamw", "lion"):
        r = probes.check(136, 264, 100, rule, wdt, sdt, config=config)
        assert r["bitwise"] and r["moved"] > 0


@gpu
@pytest.mark.parametrize("name", list(_DW16))
@pytest.mark.parametrize("wdt,sdt", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")])
def test_a_bf16_dw_hand_over_gives_the_same_bits(name, wdt, sdt):
    """DW16: fused equals its own (bf16-rounded) dW + the update kernel; every dW entry a bf16 value,
    dYᵀX within its rounding."""
    for rule in ("adamw", "lion"):
        r = probes.check(136, 264, 100, rule, wdt, sdt, config=_DW16[name])
        assert r["bitwise"] and r["moved"] > 0
        assert r["dw_is_bf16"] and r["dw_rel_err"] < 2.0**-8


@gpu
@pytest.mark.parametrize("group_m", [3, 8, 16])
def test_the_grouped_tile_order_gives_the_row_major_bits(group_m):
    """GROUP_M only changes which program runs which tile and when: W, the states and the tiles' sums
    of squares (stored at the row-major tile index) equal the row-major order's bit for bit, also with a
    partial last group (8 block rows by 3) and more tiles than programs (CTAS 5)."""
    from leantrain.forge.launch import RULE_IDS
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 1000, 1104, 300  # 8 x 9 tiles of 128 x 128 (rows of 16-byte multiples: TMA)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-2
    w0 = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    st0 = [(torch.randn(n, k, device="cuda", generator=gen) * 1e-3).abs() for _ in range(2)]
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 3)
    out = []
    for cfg in ({"CTAS": 5}, {"CTAS": 5, "GROUP_M": group_m}, {"GROUP_M": group_m, "DW16": 1},
                {"DW16": 1}):
        w, st = w0.clone(), [s.clone() for s in st0]
        part = ws.launch_ws(0, x=x, dy=dy, w=w, states=st, kinds=["fp32", "fp32"], scal=scal, flags=flags,
                            rule_id=RULE_IDS["adamw"], config=cfg)
        out.append((w, *st, part.clone()))
    for a, b in ((out[0], out[1]), (out[3], out[2])):
        assert all(torch.equal(u.view(torch.int32), v.view(torch.int32)) for u, v in zip(a, b, strict=True))
    assert not torch.equal(out[0][0], w0)


@gpu
@pytest.mark.parametrize("config", [{"APPROX": 1}, {"APPROX": 1, "DW16": 1, **ws.DEEP16_CONFIG, "GROUP_M": 16}])
@pytest.mark.parametrize("wdt,sdt", [("fp32", "fp32"), ("bf16", "bf16")])
def test_fast_math_fused_equals_its_dw_then_the_fast_math_update_kernel(config, wdt, sdt):
    """APPROX (fast_math): the fused update equals the kernel's own dW + the update-only kernel with the
    same approximate rule, bit for bit, for the rules it changes (AdamW, AdamS) and one it does not."""
    for rule in ("adamw", "adams", "lion"):
        r = probes.check(136, 264, 100, rule, wdt, sdt, config=config)
        assert r["bitwise"] and r["moved"] > 0


@gpu
def test_a_bf16_dw_tile_is_the_fp32_tile_rounded_to_nearest():
    """DW16 rounds the same fp32 accumulator that mode 1 writes: dW(DW16) == dW(fp32).to(bf16), entry for entry."""
    from leantrain.forge.launch import RULE_IDS
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 512, 384, 1000
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda")
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 1)
    g32, g16 = torch.empty(n, k, device="cuda"), torch.empty(n, k, device="cuda")
    for g, dw16 in ((g32, False), (g16, True)):
        ws.launch_ws(1, x=x, dy=dy, w=w, g=g, scal=scal, flags=flags, rule_id=RULE_IDS["adamw"], config={},
                     dw_bf16=dw16)
    assert torch.equal(g16, g32.to(torch.bfloat16).float())
    assert not torch.equal(g16, g32)


@gpu
def test_unaligned_weights_and_states_fall_back_to_plain_loads():
    from leantrain.forge.launch import RULE_IDS
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 136, 264, 100  # W and its states at a 4-byte offset: TMA cannot load them
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-2
    bufs = [torch.randn(n * k + 1, device="cuda") * 0.02 for _ in range(3)]
    w, m, v = (b[1:].view(n, k) for b in bufs)
    m.abs_(), v.abs_()
    assert w.data_ptr() % 16
    ref = [t_.clone() for t_ in (w, m, v)]  # (aligned copies, through the plain loads)
    w0 = w.clone()
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 3)
    for ww, st, cfg in ((w, [m, v], None), (ref[0], ref[1:], ws.PLAIN_CONFIG)):
        ws.launch_ws(0, x=x, dy=dy, w=ww, states=st, kinds=["fp32", "fp32"], scal=scal, flags=flags,
                     rule_id=RULE_IDS["adamw"], config=cfg)
    assert not torch.equal(w, w0)
    assert all(torch.equal(a_, b_) for a_, b_ in zip((w, m, v), ref, strict=True))


@gpu
def test_the_probes_run_the_gemm_alone_and_the_update_alone():
    from leantrain.forge.launch import MODE_UPDATE, RULE_IDS, launch_forge
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 256, 384, 200
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-2
    w = torch.randn(n, k, device="cuda") * 0.02
    m, v = (torch.randn(n, k, device="cuda") * 1e-3).abs(), (torch.randn(n, k, device="cuda") * 1e-3).abs()
    w0, m0, v0 = w.clone(), m.clone(), v.clone()
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 3)
    kw = dict(x=x, dy=dy, kinds=["fp32", "fp32"], scal=scal, flags=flags, rule_id=RULE_IDS["adamw"])
    g = torch.empty(n, k, device="cuda")
    part1 = ws.launch_ws(1, w=w.clone(), g=g, **kw).clone()
    part2 = ws.launch_ws(ws.PROBE_GEMM, w=w, states=[m, v], **kw)  # the GEMM alone: the same tile sums, nothing stored
    assert torch.equal(part2, part1) and bool((part1 > 0).all())
    assert torch.equal(w, w0) and torch.equal(m, m0) and torch.equal(v, v0)
    part3 = ws.launch_ws(ws.PROBE_UPDATE, w=w, states=[m, v], **kw)  # the update alone: the update kernel's bits on dW = 0
    assert bool((part3 == 0).all()) and not torch.equal(w, w0)
    launch_forge(MODE_UPDATE, g=torch.zeros_like(g), w=w0, states=[m0, v0], kinds=["fp32", "fp32"], rule_name="adamw",
                 hp=probes.RULE_HP["adamw"], step=3)
    assert torch.equal(w, w0) and torch.equal(m, m0) and torch.equal(v, v0)


@gpu
def test_a_traced_launch_gives_the_same_bits_and_ordered_stamps():
    from leantrain.forge.launch import RULE_IDS
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 512, 640, 300  # 20 tiles on 8 programs: each runs 2 or 3
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-2
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 3)
    outs = []
    for trace in (None, {}):
        w = torch.ones(n, k, device="cuda") * 0.02
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        ws.launch_ws(0, x=x, dy=dy, w=w, states=[m, v], kinds=["fp32", "fp32"], scal=scal, flags=flags,
                     rule_id=RULE_IDS["adamw"], config={"CTAS": 8}, trace=trace)
        outs.append((w, m, v))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    st = trace["stamps"]
    assert st.shape == (8, 3, 8)
    done = st[:, :, 0] > 0
    assert int(done.sum()) == 20  # every tile stamped once, by the program that ran it
    ev = st[done][:, :5]
    assert bool((ev[:, 1:] >= ev[:, :-1]).all())  # start <= GEMM done <= slot free <= update has it <= done


@gpu
def test_a_non_finite_tile_keeps_its_weights():
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 256, 256, 128
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    dy[5, 3] = float("nan")  # output feature 3: W's rows 0..127 (the first row tile), every column
    w = torch.randn(n, k, device="cuda")
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    w0 = w.clone()
    scal, flags = _scalars("adamw", probes.RULE_HP["adamw"], 1)
    part = ws.launch_ws(0, x=x, dy=dy, w=w, states=[m, v], kinds=["fp32", "fp32"], scal=scal, flags=flags, rule_id=1)
    assert torch.equal(w[:128], w0[:128]) and torch.equal(m[:128], torch.zeros_like(m[:128]))
    assert not torch.equal(w[128:], w0[128:]) and bool(torch.isfinite(w).all())
    assert not bool(torch.isfinite(part[:2]).any()) and bool(torch.isfinite(part[2:]).all())


@gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_forge_layers_run_it_below_ws_tokens(state_dtype, grad_dtype, monkeypatch):
    """attach(ws_tokens=...): the model's linear layers take the Gluon kernel, and the weights follow
    the split path's (cuBLAS dW) within the two dW summation orders' difference (SGD with momentum: an
    update linear in dW; Adam's first steps are ±lr wherever |dW| is tiny, so a last-bit difference
    of a near-zero gradient could move a weight by 2 lr). ``grad_dtype="bf16"``: the kernel hands the tile
    over in bf16, as the split path's bf16 matmul rounds its dW."""
    import leantrain as lt

    calls = []
    real = ws.launch_ws
    monkeypatch.setattr(ws, "launch_ws", lambda *a, **kw: calls.append(kw["dw_bf16"]) or real(*a, **kw))

    def run(ws_tokens):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256, bias=False)).cuda()
        opt = lt.forge.attach(model, lt.optim.SGD(lr=0.1, momentum=0.9), state_dtype=state_dtype, ws_tokens=ws_tokens,
                              grad_dtype=grad_dtype)
        x = torch.randn(300, 256, device="cuda")
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert opt.last_nonfinite == []
        return [p.detach().clone() for p in model.parameters()]

    split = run(None)
    assert calls == []
    fused = run(1 << 30)
    if state_dtype == "bf16":  # (bf16 states stay on the split path: faster there, s28 fifth/)
        assert calls == []
        return
    assert calls == [grad_dtype == "bf16"] * 6  # two layers, three steps
    for a, b in zip(split, fused, strict=True):
        assert ((a - b).abs().mean() / a.abs().mean()).item() < 1e-4


@gpu
@pytest.mark.parametrize("scale", [0.25, float("nan")])
def test_a_clip_scale_is_applied_as_the_update_kernel_applies_it(scale):
    from leantrain.forge.launch import MODE_UPDATE, launch_forge
    from leantrain.forge.launch import scalars as _scalars

    n, k, t = 256, 384, 200
    torch.manual_seed(2)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(n, k, device="cuda")
    sc = torch.tensor(scale, device="cuda")
    hp = probes.RULE_HP["adamw"]
    scal, flags = _scalars("adamw", hp, 2)
    g = torch.empty(n, k, device="cuda")
    ws.launch_ws(1, x=x, dy=dy, w=w0.clone(), g=g, scal=scal, flags=flags)
    w1, st1 = w0.clone(), [torch.zeros_like(w0), torch.zeros_like(w0)]
    ws.launch_ws(0, x=x, dy=dy, w=w1, states=st1, kinds=["fp32"] * 2, scal=scal, flags=flags, scale=sc)
    w2, st2 = w0.clone(), [torch.zeros_like(w0), torch.zeros_like(w0)]
    launch_forge(MODE_UPDATE, g=g, w=w2, states=st2, kinds=["fp32"] * 2, rule_name="adamw", hp=hp, step=2, scale=sc)
    assert torch.equal(w1, w2) and torch.equal(st1[0], st2[0]) and torch.equal(st1[1], st2[1])
    assert torch.equal(w1, w0) == (scale != scale)  # a NaN scale stores nothing


def test_ws_tokens_and_kernel_are_checked():
    import leantrain as lt

    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="ws_tokens"):
        lt.forge.attach(model, lt.optim.AdamW(lr=1e-3), ws_tokens=0)
    with pytest.raises(ValueError, match="kernel"):
        lt.forge.attach(model, lt.optim.AdamW(lr=1e-3), kernel="fast")
    opt = lt.forge.attach(model, lt.optim.AdamW(lr=1e-3), ws_tokens=4096, kernel="ws")
    assert opt.ws_tokens == 4096 and opt.kernel == "ws"
    lt.forge.detach(model)


def test_the_dispatch_rule():
    """``choose_path``: the table of forge/dispatch.py."""
    from leantrain.forge.dispatch import choose_path

    def path(kernel, t, **kw):
        args = dict(on_cuda=True, must_materialize=False, ws_ok=True, split_tokens=1, ws_tokens=None) | kw
        return choose_path(kernel, t, **args)

    assert path("auto", 512) == "split" and path("auto", 512, on_cuda=False) == "tiles"
    assert path("auto", 512, ws_tokens=4096) == "ws" and path("auto", 8192, ws_tokens=4096) == "split"
    assert path("auto", 512, split_tokens=None) == "tiles" and path("auto", 512, split_tokens=1024) == "tiles"
    assert path("ws", 1 << 20) == "ws" and path("ws", 512, ws_ok=False) == "split"
    assert path("tiles", 512) == "tiles" and path("split", 512, on_cuda=False) == "split"
    assert path("tiles", 512, must_materialize=True) == "split"


@gpu
@pytest.mark.parametrize("wdt", ["fp32", "bf16"])
def test_device_scalars_give_the_argument_bits_and_a_nan_gate_stores_nothing(wdt):
    """``dyn``: the step's scalars and key from a row of kernel.py's device table (what a CUDA
    graph replays) == the same values as launch arguments; a NaN gate (a graph's warm-up) stores
    nothing but still writes the tile sums."""
    import numpy as np

    from leantrain.forge.launch import DYN_COLS, RULE_IDS, dyn_row
    from leantrain.forge.launch import scalars as _scalars

    n, k, t, key = 136, 264, 100, 1234
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-2
    dt = torch.float32 if wdt == "fp32" else torch.bfloat16
    w0 = (torch.randn(n, k, device="cuda") * 0.02).to(dt)
    st0 = [(torch.randn(n, k, device="cuda") * 1e-3).abs().to(dt) for _ in range(2)]
    hp = probes.RULE_HP["adamw"]
    scal, flags = _scalars("adamw", hp, 3)
    row = dyn_row("adamw", hp, 3)
    row[12:13].view(np.int32)[:] = key
    table = torch.zeros(2, DYN_COLS, device="cuda")
    table[1] = torch.from_numpy(row)
    runs = []
    for dyn in (None, (table, 1)):
        w, st = w0.clone(), [s.clone() for s in st0]
        part = ws.launch_ws(0, x=x, dy=dy, w=w, states=st, kinds=[wdt] * 2, scal=scal, flags=flags,
                            rule_id=RULE_IDS["adamw"], key=key, dyn=dyn)
        runs.append([w, *st, part.clone()])
    assert not torch.equal(runs[0][0], w0)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    table[1, 11] = float("nan")  # the gate
    w, st = w0.clone(), [s.clone() for s in st0]
    part = ws.launch_ws(0, x=x, dy=dy, w=w, states=st, kinds=[wdt] * 2, scal=scal, flags=flags,
                        rule_id=RULE_IDS["adamw"], dyn=(table, 1))
    assert torch.equal(w, w0) and all(torch.equal(a, b) for a, b in zip(st, st0, strict=True))
    assert torch.equal(part, runs[0][3])

