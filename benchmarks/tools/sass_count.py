"""Count the SASS instructions and registers of leantrain's quantize kernels, without a GPU.

    PYTHONPATH=src python3 benchmarks/tools/sass_count.py quant --words 1 --bits 4 --fast 31 --warps 4 --rows 32
    PYTHONPATH=src python3 benchmarks/tools/sass_count.py multi --kind -1 --bits 0 --fast 31 --warps 4 --rows 32
    PYTHONPATH=src python3 benchmarks/tools/sass_count.py dequant --kind 1 --bits 4 --rows 16 --tpp 4 --aligned 1
    PYTHONPATH=src python3 benchmarks/tools/sass_count.py clip --idx64 0
    PYTHONPATH=src python3 benchmarks/tools/sass_count.py forge --bn 16 --bk 128 --warps 8 --sdtype bf16 --early 1
    PYTHONPATH=src python3 benchmarks/tools/sass_count.py ws --approx 1

Triton's wheel carries ``ptxas``, ``nvdisasm`` and ``cuobjdump``, so a kernel compiles for
sm_90 (the H200) on any machine. Printed per kernel: the static instruction count, the count up
to the first ``EXIT`` (the main path, every branch included), the "clean" path (the main path
less the blocks that an unconditional branch jumps over, i.e. with each clean-tile branch
taken; an estimate), the registers a thread needs, and the most frequent opcodes. Pointer and
size arguments are specialized as divisible by 16, as a launch on real tensors gives them.
It shows what a GPU run can only time: which branch a tile takes, how many instructions it costs.
Counts are per thread: divide by the elements a thread holds (tile elements / (32 * warps)).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import forge_probes  # noqa: E402  (benchmarks/tools, the script's directory)

os.environ.pop("TRITON_INTERPRET", None)  # (a compiled kernel, not the interpreter's)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

_INSN = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")  # (addresses past 0xffff take five digits)


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, divisible: tuple[str, ...],
                 maxnreg: int | None = None, num_stages: int | None = None):
    """(SASS text, resource line) of ``fn`` compiled for sm_90 (``maxnreg``: ptxas register cap)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "enable_fp_fusion": False}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    if num_stages:
        opts["num_stages"] = num_stages
    return disassemble(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))


def disassemble(ck):
    """(SASS text, resource line) of a compiled kernel (Triton's or Gluon's ``CompiledKernel``)."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                             capture_output=True, text=True, check=True).stdout
    dyn = getattr(ck.metadata, "shared", 0)  # Triton's shared memory is dynamic: not in the resource line
    return sass, next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "") + f" DYNAMIC_SHARED:{dyn}"


def counts(sass: str) -> dict:
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
        elif _INSN.match(line):
            ins.append(line)
    ops = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0]
                              for ln in ins)
    end = next((k for k, ln in enumerate(ins) if "EXIT" in ln), len(ins) - 1)
    skip: set[int] = set()
    for k, ln in enumerate(ins[:end]):
        m = re.search(r"\sBRA `\((\.?L_x_\d+)\)", ln)
        if m and not re.match(r"\s*@", ln.split("*/", 1)[1]):
            target = labels.get(m.group(1).lstrip("."), k)
            if target > k:
                skip.update(range(k + 1, target))
    return {"total": len(ins), "main": end + 1, "clean": sum(1 for k in range(end + 1) if k not in skip),
            "ops": ops.most_common(12)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["quant", "multi", "dequant", "state8", "clip", "forge", "swiglu", "ws"])
    ap.add_argument("--bits", type=int, default=4, help="4 or 8 (multi: 0 = widths mixed)")
    ap.add_argument("--fast", type=int, default=31, help="the quant.FAST constexpr")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32, help="groups of 128 per tile (state8: blocks of 256)")
    ap.add_argument("--words", type=int, default=1, help="quant: 1 = bf16 read as 32-bit words, 0 = elements")
    ap.add_argument("--dtype", default="bf16", help="quant, element path: input type (bf16, fp32)")
    ap.add_argument("--kind", type=int, default=1, help="multi: 0 fp32, 1 bf16, 2 fp16, -1 mixed")
    ap.add_argument("--tpp", type=int, default=1, help="multi: tiles per program")
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap a thread (0: none)")
    ap.add_argument("--aligned", type=int, default=1, help="multi, dequant: the ALIGNED constexpr (address / size hints)")
    ap.add_argument("--idx64", type=int, default=0, help="clip: the layer's size passed as a 64-bit integer")
    ap.add_argument("--bn", type=int, default=16, help="forge: BLOCK_N")
    ap.add_argument("--bk", type=int, default=128, help="forge: BLOCK_K")
    ap.add_argument("--wdtype", default="bf16", help="forge: W's dtype (bf16 with SR, or fp32)")
    ap.add_argument("--sdtype", default="bf16", help="forge: the AdamW states' kind (fp32, bf16, int8, int8p)")
    ap.add_argument("--early", type=int, default=0, help="forge: EARLY_LOADS")
    ap.add_argument("--sr", type=int, default=1, help="forge: stochastic rounding of bf16 W")
    ap.add_argument("--mode", default="update", choices=["update", "fused", "forward", "backward"],
                    help="forge: the update-only mode (a graph's launch) or the fused dW + update (bf16 X / dY); "
                         "swiglu: forward or backward")
    ap.add_argument("--bt", type=int, default=64, help="forge --mode fused: BLOCK_T")
    ap.add_argument("--approx", type=int, default=0, help="ws: APPROX (fast_math's approximate sqrt / division)")
    ap.add_argument("--stages", type=int, default=3, help="forge --mode fused: num_stages")
    a = ap.parse_args(argv)
    if a.kernel == "ws":  # FORGE's warp-specialized kernel (Gluon, fp32 W / m / v, AdamW, WS_CONFIG), whole

        sass, res = disassemble(forge_probes.compile_sm90(0, config={"APPROX": a.approx}))
        c = counts(sass)
        ins = [ln for ln in sass.splitlines() if _INSN.match(ln)]
        print(f"ws APPROX={a.approx}: instructions {c['total']} (every partition), CALL {sum('CALL' in ln for ln in ins)}, "
              f"BRA {sum(' BRA' in ln for ln in ins)}, FCHK {sum('FCHK' in ln for ln in ins)}")
        print(f"resources: {res}")
        return 0
    qhi = (1 << (a.bits - 1)) - 1 if a.bits else 0
    if a.kernel == "quant":
        from leantrain.ops import quant

        fn = quant._quantize_kernel
        sig = {"x_ptr": "*i32" if a.words else f"*{a.dtype}", "data_ptr": "*u8", "scale_ptr": "*fp32",
               "zero_ptr": "*fp32", "n": "i64", "n_groups": "i64", "key": "i32"}
        cons = dict(GS=128, COLS=128, ROWS=a.rows, BITS=a.bits, SYMMETRIC=True, STOCHASTIC=True, QLO=-qhi, QHI=qhi,
                    IDX32=True, PAIRS=True, FAST=a.fast, WORDS=a.words, EXP=False)
        div = ("x_ptr", "data_ptr", "scale_ptr", "zero_ptr", "n", "n_groups")
    elif a.kernel == "state8":
        from leantrain.ops import state8

        fn = state8._encode_kernel
        sig = {"x_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32", "qmap_ptr": "*fp32", "n": "i64",
               "n_blocks": "i64"}
        cons = dict(BS=256, COLS=256, ROWS=a.rows, SIGNED=True)
        div = tuple(sig)
    elif a.kernel == "clip":  # FORGE's clip scale (forge/gradsums.py), est_global
        from leantrain.forge import gradsums

        fn = gradsums._clip_scale_kernel
        sig = {"G": "*fp32", "n": "i64" if a.idx64 else "i32", "chunk": "i32", "npart": "i32", "PART": "*fp32",
               "TICKET": "*i32", "SQ": "*fp32", "SCALE": "*fp32", "RUN": "*fp32", "PRED": "*fp32", "TOTAL": "*fp32",
               "slot": "i32", "has_pred": "i32", "have_total": "i32", "clip": "fp32"}
        cons = dict(EST=True, BLOCK=gradsums._GPU_BLOCK, PBLOCK=512)
        div = ("G", "n", "chunk")
    elif a.kernel == "forge":  # FORGE's update-only mode (the split path's second half), AdamW, a graph's launch
        from leantrain.forge import kernel as fk
        from leantrain.ops.update import RULE_IDS, STATE_KIND

        fn = fk._forge_kernel
        kind = STATE_KIND[a.sdtype]
        sdt = {"fp32": "*fp32", "bf16": "*bf16", "int8": "*u8", "int8p": "*u8"}[a.sdtype]
        sig = {n: "*fp32" for n in ("X", "DY", "W", "B", "S1", "S2", "A1", "A2", "BS1", "BS2", "Q1", "Q2", "G", "GB",
                                    "PART", "SCALE", "DYN", "SQ", "TICKET", "ACC", "ACS", "ACR", "ACRS")}
        sig.update(W=f"*{a.wdtype}", S1=sdt, S2=sdt, G="*bf16", TICKET="*i32", OWNER="*i32", KEYS="*i32", ROW0="*i32")
        sig.update({n: "i32" for n in ("T", "N", "K", "stride_x", "stride_dy")})
        sig.update({n: "fp32" for n in ("lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2", "lerp_c",
                                        "eps", "mom")})
        sig.update(key="i32", dyn_off="i32")
        fused = a.mode == "fused"
        if fused:
            sig.update(X="*bf16", DY="*bf16")
        cons = dict(MODE=fk.MODE_FUSED if fused else fk.MODE_UPDATE, RULE=RULE_IDS["adamw"], KIND1=kind, KIND2=kind, NSTATE=2, APPROX=False,
                    W_BF16=a.wdtype == "bf16", SR=bool(a.sr), HAS_BIAS=False, HAS_DECAY=True, HAS_MOM=False,
                    NESTEROV=False, LERP_SMALL=True, HAS_SCALE=False, PREC="tf32" if fused else "ieee", HAS_DYN=True,
                    SUM_OUT=True, BLOCK_N=a.bn, BLOCK_K=a.bk, BLOCK_T=a.bt if fused else 16, GROUP_N=8, IDX32=True, NATIVE_CVT=2,
                    SIGN1=1 if kind >= 2 else -1, SIGN2=0 if kind >= 2 else -1, EARLY_LOADS=bool(a.early), ROWS=False,
                    ACC_KIND=0, ACC_READ=False, ACC_GROUP=1, FAST=0)  # (no accumulated gradient)
        if not fused:
            raise SystemExit("forge --mode update: the update-only kernel is ops.update._update_kernel now; "
                             "count --mode fused here")
        sig = {k: v for k, v in sig.items() if k in fn.arg_names}  # (the fused kernel's own arguments)
        cons = {k: v for k, v in cons.items() if k in fn.arg_names}
        div = tuple(k for k, v in sig.items() if v.startswith("*")) + ("N", "K") + (("stride_x", "stride_dy") if fused else ())
    elif a.kernel == "swiglu":  # ops/swiglu.py, rows of 1024 elements (the MLP's width), --dtype, --mode
        from leantrain.ops import swiglu

        fn = swiglu._swiglu_kernel
        sig = {n: f"*{a.dtype}" for n in ("G", "U", "X", "DG", "DU")}
        sig.update({n: "i32" for n in ("M", "N", "s_g", "s_u", "s_x", "s_dg", "s_du")})
        cons = dict(BACKWARD=a.mode == "backward", BM=2, BN=1024)
        div = ("G", "U", "X", "DG", "DU", "s_g", "s_u", "s_x", "s_dg", "s_du")
    elif a.kernel == "dequant":
        from leantrain.ops import multi

        fn = multi._dequantize_many_kernel
        sig = {"tab_ptr": "*i64", "n_tensors": "i32"}
        cons = dict(TP=16, KIND=a.kind, HW_CAST=True, GS=128, COLS=128, ROWS=a.rows, BITS=a.bits, SYMMETRIC=True,
                    ALIGNED=bool(a.aligned), FAST=a.fast, TPP=a.tpp)
        div = ("tab_ptr",)
    else:
        from leantrain.ops import multi

        fn = multi._quantize_many_kernel
        sig = {"tab_ptr": "*i64", "n_tensors": "i32"}
        cons = dict(TP=16, KIND=a.kind, GS=128, COLS=128, ROWS=a.rows, BITS=a.bits, SYMMETRIC=True, STOCHASTIC=True,
                    IDX32=True, ALIGNED=bool(a.aligned), NATIVE=True, PAIRS=True, FAST=a.fast, TPP=a.tpp, WORDS=True)
        div = ("tab_ptr",)
    stages = a.stages if a.kernel == "forge" and a.mode == "fused" else None
    sass, res = compile_sass(fn, sig, cons, a.warps, div, a.maxnreg or None, stages)
    c = counts(sass)
    if a.kernel == "clip":
        per = gradsums._GPU_BLOCK / (32 * a.warps)
    elif a.kernel == "forge":
        per = a.bn * a.bk / (32 * a.warps)
    elif a.kernel == "swiglu":
        per = 2 * 1024 / (32 * a.warps)
    else:
        per = a.rows * (256 if a.kernel == "state8" else 128) * a.tpp / (32 * a.warps)
    print(f"{a.kernel} {cons}  num_warps={a.warps}")
    print(f"instructions per thread: total {c['total']}, main path {c['main']}, clean path {c['clean']} "
          f"({c['clean'] / per:.1f} an element, {per:.0f} elements a thread)")
    print(f"resources: {res}")
    reg, static, dyn = (int(m.group(1)) if (m := re.search(rf"\b{k}:(\d+)", res)) else 0
                        for k in ("REG", "SHARED", "DYNAMIC_SHARED"))
    shared = static + dyn
    if reg:  # sm_90: 64 K registers (allocated per warp in units of 256) and 228 KB of shared memory an SM
        by_reg = 65536 // (-(-reg * 32 // 256) * 256 * a.warps)
        by_smem = (228 * 1024) // (shared + 1024) if shared else 32
        print(f"resident programs an SM (sm_90): {min(by_reg, by_smem, 64 // a.warps, 32)} "
              f"(registers allow {by_reg}, shared memory {by_smem})")
    print("opcodes:", ", ".join(f"{k} {v}" for k, v in c["ops"]))
    mem = collections.Counter(m.group(0) for m in re.finditer(r"\b(?:STG|LDG)(?:\.\w+)*", sass))
    print("global loads / stores:", ", ".join(f"{k} {v}" for k, v in sorted(mem.items())))
    sync = collections.Counter(m.group(0) for m in re.finditer(r"\b(?:ATOMG|MEMBAR|CCTL|BAR)(?:\.\w+)*", sass))
    print("atomics / fences / barriers:", ", ".join(f"{k} {v}" for k, v in sorted(sync.items())) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
