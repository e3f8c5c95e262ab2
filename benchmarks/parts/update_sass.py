"""Static cost of the optimizer update kernel (``ops.update._update_kernel``) per element, without a GPU.

    PYTHONPATH=src python3 benchmarks/bench_forge.py --part sass --out benchmarks/results/forge

The kernel is compiled for sm_90a (Triton's wheel carries ``ptxas``, ``nvdisasm`` and ``cuobjdump``)
with the constexprs and tile the launcher builds (:func:`leantrain.ops.update_launch.update_meta`,
:func:`~leantrain.ops.update_launch.update_plan`), for FORGE's update-only launch of a bf16 W with
stochastic rounding and AdamW's two states in fp32, bf16, int8 (codes + an absmax tensor), int8p
(absmax in the codes) and fp8 (e4m3 codes + an absmax tensor), from an fp32 gradient. Reported per configuration: the SASS instructions
by class on the main path (up to the first ``EXIT``: every branch, no out-of-line slow path) per
element of the tile (a thread's instructions / the elements a thread holds), the registers a
thread, local-memory spills, shared memory, and the ``convert_layout`` ops of the TTGIR (layout
changes: shared-memory round trips unless they stay within a warp). Counts are static: a loop
body counts once. The GPU machine's Triton may schedule differently (the versions are recorded).
"""

from __future__ import annotations

import ast
import collections
import functools
import os
import re
import subprocess
import tempfile

import torch

# opcode (without modifiers) -> class; unlisted opcodes count as "other"
CLASSES = {
    "global_load": ("LDG", "LD"),
    "global_store": ("STG", "ST", "RED", "ATOMG", "ATOM"),
    "shared_load": ("LDS", "LDSM"),
    "shared_store": ("STS", "ATOMS"),
    "barrier": ("BAR", "MEMBAR", "DEPBAR", "ERRBAR", "CCTL"),
    "shuffle": ("SHFL", "VOTE", "REDUX", "MATCH"),
    "mufu": ("MUFU",),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FCHK", "FSWZADD", "FMUL32I", "FADD32I", "FFMA32I"),
    "integer": ("IADD3", "IMAD", "LOP3", "SHF", "LEA", "IMNMX", "SEL", "PRMT", "IABS", "POPC", "FLO", "BMSK",
                "SGXT", "IADD", "ISCADD", "LOP", "SHL", "SHR", "BREV", "IMUL", "IADD32I", "LOP32I", "IMAD32I",
                "MOV", "MOV32I", "VIADD", "VIMNMX"),
    "conversion": ("F2F", "F2I", "I2F", "F2FP", "I2FP", "I2I", "FRND", "F2IP"),
    "predicate_branch": ("ISETP", "FSETP", "PLOP3", "P2R", "R2P", "BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET",
                         "WARPSYNC", "BREAK", "JMP", "PSETP"),
    "uniform_special": ("S2R", "S2UR", "CS2R", "ULDC", "UMOV", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA",
                        "UISETP", "USEL", "UPRMT", "R2UR", "UFLO", "UPOPC", "USGXT", "UBMSK", "UPLOP3", "UP2UR",
                        "VOTEU", "UIMNMX"),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}
_INSN = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)")

# the FORGE state layouts compared (the kinds of leantrain.ops.update.STATE_KIND)
STATE_LAYOUTS = ("fp32", "bf16", "int8", "int8p", "fp8")


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def launch_config(state: str, N: int = 4096, K: int = 11008, tune: dict | None = None) -> tuple:
    """``(kernel, signature, constexprs, options)`` of the update-only launch of a bf16 ``[N, K]`` W
    with SR and AdamW states of kind ``state``, as :func:`~leantrain.ops.update_launch.launch_update`
    builds it on a GPU (tensors on the meta device: only their dtypes matter); ``tune``: a tile
    (``BLOCK_N, BLOCK_K, num_warps``) instead of the launcher's, as ``launch_update(tune=...)``."""
    from leantrain.ops import update_launch as U
    from leantrain.ops.state8 import StateCodec8
    from leantrain.ops.update import Fp8Table

    meta_dev = torch.device("meta")
    w = torch.empty(N, K, dtype=torch.bfloat16, device=meta_dev)
    g = torch.empty(N, K, dtype=torch.float32, device=meta_dev)
    part = torch.empty(1, dtype=torch.float32, device=meta_dev)
    ticket = torch.empty((), dtype=torch.int32, device=meta_dev)
    if state in ("fp32", "bf16"):
        dtype = torch.float32 if state == "fp32" else torch.bfloat16
        states, qtables = [torch.empty(N, K, dtype=dtype, device=meta_dev)] * 2, [None, None]
    elif state == "fp8":
        codes = torch.empty(N // 16, K // 16, 16, 16, dtype=torch.float8_e4m3fn, device=meta_dev)
        absmax = torch.empty(N // 16, K // 16, dtype=torch.float32, device=meta_dev)
        qtables = [(Fp8Table(s), absmax) for s in (True, False)]
        states = [codes, codes]
    else:
        codes = torch.empty(N // 16, K // 16, 16, 16, dtype=torch.uint8, device=meta_dev)
        absmax = None if state == "int8p" else torch.empty(N // 16, K // 16, dtype=torch.float32, device=meta_dev)
        qtables = [(StateCodec8(signed=s).qmap_on("cpu"), absmax) for s in (True, False)]
        states = [codes, codes]
    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    e = U.epilogue_args("adamw", hp, 10, [state, state], qtables, None)
    meta = U.update_meta(e, N=N, K=K, rule_name="adamw", nstate=2, w_bf16=True, sr=True, has_bias=False,
                         has_scale=False, has_dyn=False, sum_out=True, native=2, rows=False, approx=False)
    plan = U.update_plan(N, K, tune, True, meta)
    args = U.update_args(e, N, K, w, g, None, None, states, (), qtables, None, part, None, part, ticket, None, 123)
    kernel = plan.kernel
    names = list(kernel.arg_names)
    dtypes = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.int32: "*i32"}
    signature = {}
    for name, arg in zip(names, args):
        if isinstance(arg, torch.Tensor):
            signature[name] = dtypes[arg.dtype]
        else:
            signature[name] = "i32" if isinstance(arg, int) else "fp32"
    constexprs = {n: plan.meta[n] for n in names[len(args):]}
    options = {k: plan.meta[k] for k in ("num_warps", "num_stages", "enable_fp_fusion")}
    return kernel, signature, constexprs, options


def compile_sm90(kernel, signature: dict, constexprs: dict, options: dict):
    """The Triton ``CompiledKernel`` for sm_90a; pointers and the ``N`` / ``K`` sizes specialized
    as divisible by 16 (as a launch on real tensors of the 7b shapes gives them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.pop("TRITON_INTERPRET", None)
    names = list(signature)
    divisible = [k for k, v in signature.items() if v.startswith("*")] + ["N", "K"]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(ck) -> tuple[str, str]:
    """``(SASS text, cuobjdump's resource line)`` of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(_tools(), "nvdisasm"), "-c", "-g", path], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(_tools(), "cuobjdump"), "--dump-resource-usage", path],
                             capture_output=True, text=True, check=True).stdout
    return sass, next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "")


_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


@functools.cache
def _functions(path: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, name)`` of every function in the Python file ``path``."""
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return []
    return [(min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno, n.name)  # (from its decorators)
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _function_at(path: str, line: int) -> str:
    """``"file.py:function"``: the innermost function of ``path`` holding ``line`` (a path of another
    checkout, as a cached compile may carry, is read from this tree's ``src/leantrain``)."""
    if not os.path.exists(path) and "/leantrain/" in path:
        path = os.path.join(os.path.dirname(__file__), "..", "..", "src", "leantrain", path.split("/leantrain/", 1)[1])
    spans = [(first, name) for first, last, name in _functions(path) if first <= line <= last]
    return f"{os.path.basename(path)}:{max(spans)[1] if spans else '?'}"


def classify(sass: str) -> dict:
    """SASS instruction counts by class (:data:`CLASSES`): ``main`` up to the first ``EXIT``,
    ``total`` the whole kernel (``NOP`` padding left out), the main path's opcodes, and (SASS
    disassembled with ``-g``) its instructions by source line (``"file.py:line"``) and by the
    source function they were inlined from (``"file.py:function"``)."""
    ops, where, here = [], [], ("?", 0)
    for line in sass.splitlines():
        if (m := _LINE.search(line)) is not None:
            here = (m.group(1), int(m.group(2)))
        elif (m := _INSN.match(line)) is not None and m.group(1) != "NOP":
            ops.append(m.group(1))
            where.append(here)
    end = next((k for k, op in enumerate(ops) if op == "EXIT"), len(ops) - 1) + 1
    main = collections.Counter(ops[:end])
    by_class = collections.Counter()
    for op, n in main.items():
        by_class[_CLASS_OF.get(op, "other")] += n
    lines = collections.Counter(f"{os.path.basename(path)}:{ln}" for path, ln in where[:end])
    funcs = collections.Counter(_function_at(path, ln) for path, ln in where[:end])
    return {"main": end, "total": len(ops), "classes": dict(by_class), "opcodes": dict(main.most_common()),
            "lines": dict(lines.most_common()), "functions": dict(funcs.most_common())}


def analyse(state: str, tune: dict | None = None) -> dict:
    """The counts of one state layout's launch (:func:`launch_config`), per element and per thread."""
    kernel, sig, cons, opts = launch_config(state, tune=tune)
    ck = compile_sm90(kernel, sig, cons, opts)
    sass, res = sass_of(ck)
    c = classify(sass)
    per_thread = cons["BLOCK_N"] * cons["BLOCK_K"] / (32 * opts["num_warps"])
    field = {k: int(m.group(1)) if (m := re.search(rf"\b{k}:(\d+)", res)) else 0 for k in ("REG", "STACK", "LOCAL")}
    ttgir = ck.asm["ttgir"]
    return {
        "state": state, "tile": {k: cons[k] for k in ("BLOCK_N", "BLOCK_K")} | {"num_warps": opts["num_warps"]},
        "elements_per_thread": per_thread,
        "per_element": {"main": round(c["main"] / per_thread, 2),
                        **{k: round(v / per_thread, 2) for k, v in sorted(c["classes"].items())}},
        "per_thread": {"main": c["main"], "total": c["total"], **c["classes"]},
        "registers": field["REG"], "spill_bytes": field["LOCAL"] + field["STACK"],
        "shared_bytes": getattr(ck.metadata, "shared", 0),
        "convert_layout": ttgir.count("ttg.convert_layout"),
        "opcodes": c["opcodes"],
        "lines_per_element": {k: round(v / per_thread, 2) for k, v in c["lines"].items() if v >= per_thread / 4},
        "functions_per_element": {k: round(v / per_thread, 2) for k, v in c["functions"].items()
                                  if v >= per_thread / 8},
    }


def versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "target": "sm_90a (compiled, not run)"}


def markdown(rows: list[dict]) -> str:
    cols = ["main", "global_load", "global_store", "shared_load", "shared_store", "barrier", "shuffle", "mufu",
            "fp32", "integer", "conversion", "predicate_branch", "uniform_special", "other"]
    head = ("| states | tile (warps) | " + " | ".join(cols) + " | regs | spills | smem B | convert_layout |\n"
            + "|---" * (len(cols) + 6) + "|\n")
    lines = []
    for r in rows:
        t = r["tile"]
        per = [f"{r['per_element'].get(c, 0):g}" for c in cols]
        lines.append(f"| {r['state']} | {t['BLOCK_N']}x{t['BLOCK_K']} ({t['num_warps']}) | " + " | ".join(per)
                     + f" | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} | {r['convert_layout']} |")
    funcs = sorted({f for r in rows for f, v in r["functions_per_element"].items() if v >= 0.5},
                   key=lambda f: -max(r["functions_per_element"].get(f, 0) for r in rows))
    by_func = ["| source function | " + " | ".join(r["state"] for r in rows) + " |",
               "|---" * (len(rows) + 1) + "|"]
    by_func += [f"| {f} | " + " | ".join(f"{r['functions_per_element'].get(f, 0):g}" for r in rows) + " |"
                for f in funcs]
    return ("SASS instructions per element on the main path (a thread's / the elements it holds), by class\n\n"
            + head + "\n".join(lines) + "\n\nThe same by the source function they were inlined from "
            "(0.5 an element or more somewhere)\n\n" + "\n".join(by_func) + "\n")


def run(out, log=print) -> dict:
    """Analyse every layout of :data:`STATE_LAYOUTS`; write ``<stem>.json`` / ``.md`` into ``out``."""
    import json
    from pathlib import Path

    import harness

    rows = [analyse(s) for s in STATE_LAYOUTS]
    res = {"env": harness.env() | versions(),
           "what": "FORGE's update-only kernel compiled for sm_90a (no GPU): SASS instructions per element by class "
                   "and by source function, registers, shared memory, TTGIR layout conversions; fp32 / bf16 / int8 / "
                   "int8p / fp8 AdamW states",
           "command": "PYTHONPATH=src python3 benchmarks/bench_forge.py --part sass --out benchmarks/results/forge",
           "launch": "update-only, bf16 W [4096, 11008] + SR, AdamW (betas 0.9 / 0.95, no decay), fp32 gradient, "
                     "the tile sums summed by the last program", "rows": rows}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = harness.stem("update-sass")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(rows))
    log(markdown(rows))
    return res
