"""Probes and self-tests of FORGE's warp-specialized kernel (``leantrain.forge.ws``), kept out of the
library: ``compile_sm90`` (compile for sm_90 without a GPU: PTX, shared memory, instruction counts) and
``check`` (the fused update against the kernel's own dW + the update-only kernel, bit for bit, on this
GPU). Used by ``tune_ws.py``, ``sass_count.py``, ``bench_forge.py`` and tests/forge/test_forge_ws.py.
"""

from __future__ import annotations

import torch

from leantrain.forge.kernel import MODE_FUSED, MODE_UPDATE, MODE_WRITE_DW
from leantrain.forge.launch import launch_forge
from leantrain.forge.ws import (
    _kernel_mode,
    _schedule,
    _ws_kernel,
    launch_ws,
    resolve_config,
)
from leantrain.ops.update import RULE_IDS
from leantrain.ops.update_launch import scalars


def compile_sm90(mode: int = 0, *, w_dtype: str = "fp32", state_dtype: str = "fp32", rule_id: int = 1,
                 dyn: bool = False, config: dict | None = None, trace: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's wheel carries ptxas): the compiled
    kernel (``.asm["ptx"]``, ``.metadata.shared`` ...). For tests and instruction counts. ``config``:
    overrides of ``WS_CONFIG`` (``None``: it as is; there is no shape here for ``auto_config``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = resolve_config(config, mode)
    BM, BN, BT = cfg["BM"], cfg["BN"], cfg["BT"]
    la = gl.NVMMASharedLayout.get_default_for([BT, BM], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BT, BN], gl.bfloat16)
    sig = {"dy_desc": f"tensordesc<bf16[{BT}, {BM}],{la!r}>", "x_desc": f"tensordesc<bf16[{BT}, {BN}],{lb!r}>"}
    for name, dt in (("w_desc", w_dtype), ("s1_desc", state_dtype), ("s2_desc", state_dtype)):
        if cfg["STATE_TMA"]:
            ls = gl.NVMMASharedLayout.get_default_for([cfg["SUB"], BN], gl.float32 if dt == "fp32" else gl.bfloat16)
            sig[name] = f"tensordesc<{dt}[{cfg['SUB']}, {BN}],{ls!r}>"
        else:
            sig[name] = sig["dy_desc"]
    sig.update({"W": f"*{w_dtype}", "S1": f"*{state_dtype}", "S2": f"*{state_dtype}", "G": "*fp32", "PART": "*fp32",
           "SCALE": "*fp32", "DYN": "*fp32", "dyn_off": "i32", "TR": "*i64", "tr_j": "i32", "T": "i32", "N": "i32",
           "K": "i32"})
    sig.update({k: "fp32" for k in ("lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2", "lerp_c",
                                     "eps", "mom")})
    sig["key"] = "i32"
    names = list(sig)
    bf = state_dtype == "bf16"
    const = dict(MODE=_kernel_mode(mode), RULE=rule_id, KIND1=int(bf), KIND2=int(bf), NSTATE=2,
                 W_BF16=w_dtype == "bf16", SR=True,
                 HAS_DECAY=True, HAS_MOM=False, NESTEROV=False, LERP_SMALL=True, IDX32=True, HAS_SCALE=False,
                 HAS_DYN=dyn, TRACE=trace, **_schedule(cfg))
    sig.update({k: "constexpr" for k in const})
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("W", "S1", "S2", "G", "PART", "N", "K")}
    src = GluonASTSource(fn=_ws_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "enable_fp_fusion": False})


RULE_HP = {"sgd": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01},
           "nesterov": {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
           "adamw": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
           "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1},
           "adams": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}}  # check()'s hyper-parameters


def check(n: int, k: int, t: int, rule: str = "adamw", w_dtype: str = "fp32", state_dtype: str = "fp32",
          seed: int = 1, config: dict | None = None) -> dict:
    """Self-check on this GPU, random inputs: the fused update (mode 0) against the kernel's own dW
    (mode 1) followed by ``kernel.py``'s update kernel (``bitwise``: W and every state equal bit for
    bit), that dW against ``dYᵀX`` in fp32 (``dw_rel_err``: max error over max entry), and how far W
    moved (``moved``); with ``DW16`` in ``config``, whether every dW entry is a bf16 value
    (``dw_is_bf16``). ``rule``: a rule of ``kernel.RULE_IDS`` or ``"nesterov"`` (SGD with it)."""

    approx = bool((config or {}).get("APPROX"))  # (then the update kernel's rule is the approximate one too)
    name = "sgd" if rule == "nesterov" else rule
    hp = RULE_HP[rule]
    nst = {"sgd": 1, "adamw": 2, "lion": 1, "adams": 1}[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-2
    wd = torch.bfloat16 if w_dtype == "bf16" else torch.float32
    sd = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    w0 = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(wd)
    st0 = [(torch.randn(n, k, device="cuda", generator=gen) * 1e-3).abs().to(sd) for _ in range(nst)]
    scal, flags = scalars(name, hp, 3)
    g = torch.empty(n, k, device="cuda")
    launch_ws(MODE_WRITE_DW, x=x, dy=dy, w=w0.clone(), g=g, scal=scal, flags=flags, rule_id=RULE_IDS[name],
              config=config)
    ref = dy.float().t() @ x.float()
    w1, st1 = w0.clone(), [s.clone() for s in st0]
    launch_ws(MODE_FUSED, x=x, dy=dy, w=w1, states=st1, kinds=[state_dtype] * nst, scal=scal, flags=flags,
              rule_id=RULE_IDS[name], key=1234, config=config)
    w2, st2 = w0.clone(), [s.clone() for s in st0]
    launch_forge(MODE_UPDATE, g=g, w=w2, states=st2, kinds=[state_dtype] * nst, rule_name=name, hp=hp, step=3,
                 key=1234, approx=approx)
    def bits(t):
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    same = torch.equal(bits(w1), bits(w2)) and all(torch.equal(bits(a), bits(b)) for a, b in zip(st1, st2, strict=True))
    out = {"bitwise": same, "dw_rel_err": ((g - ref).abs().max() / ref.abs().max()).item(),
           "moved": (w1.float() - w0.float()).abs().max().item()}
    if (config or {}).get("DW16"):
        out["dw_is_bf16"] = torch.equal(g, g.to(torch.bfloat16).float())
    return out
