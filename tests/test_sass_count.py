"""benchmarks/tools/sass_count.py compiles a kernel for sm_90 without a GPU and counts its SASS: the
method behind the quantizers' clean-tile branch. The clean-tile branch (``FAST & CLEAN_TILE``, :mod:`leantrain.ops.tiles`) must cut
the path a clean tile runs, and the counter must see the branch it skips."""

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "benchmarks", "tools", "sass_count.py")


def _have_ptxas() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    bin_dir = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "nvdisasm", "cuobjdump"))


def _clean_path(fast: int) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, TOOL, "quant", "--words", "1", "--bits", "4", "--fast", str(fast),
                          "--warps", "4", "--rows", "32"], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("instructions per thread"))
    main = int(line.split("main path ")[1].split(",")[0])
    clean = int(line.split("clean path ")[1].split(" ")[0])
    return main, clean


@pytest.mark.skipif(not _have_ptxas(), reason="Triton's bundled ptxas / nvdisasm / cuobjdump not found")
def test_clean_tile_branch_shortens_the_clean_path():
    main15, clean15 = _clean_path(15)
    main31, clean31 = _clean_path(31)
    assert clean15 == main15  # no branch to skip without bit 16
    assert clean31 < main31  # the general branch is skipped on a clean tile
    assert clean31 < clean15  # and the clean path is shorter than the branch-free kernel's


@pytest.mark.skipif(not _have_ptxas(), reason="Triton's bundled ptxas / nvdisasm / cuobjdump not found")
def test_fused_forge_occupancy_counts_the_dynamic_shared_memory():
    """The fused FORGE kernel's operand buffers are dynamic shared memory: the resident-program
    estimate must count them (more pipeline stages: more bytes, never more programs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(stages: int) -> tuple[int, int]:
        out = subprocess.run([sys.executable, TOOL, "forge", "--mode", "fused", "--wdtype", "fp32", "--sdtype", "fp32",
                              "--sr", "0", "--bn", "64", "--bk", "64", "--bt", "64", "--warps", "4", "--stages",
                              str(stages)], capture_output=True, text=True, env=env, timeout=300, check=True).stdout
        dyn = int(out.split("DYNAMIC_SHARED:")[1].split()[0])
        static = int(out.split(" SHARED:")[1].split()[0])
        resident = next(ln for ln in out.splitlines() if ln.startswith("resident programs"))
        by_smem = int(resident.split("shared memory ")[1].rstrip(")"))
        assert by_smem == (228 * 1024) // (static + dyn + 1024)  # (1 KB reserved a program)
        return dyn, by_smem

    dyn2, smem2 = run(2)
    dyn4, smem4 = run(4)
    assert 0 < dyn2 < dyn4 and smem4 <= smem2


@pytest.mark.skipif(not _have_ptxas(), reason="Triton's bundled ptxas / nvdisasm / cuobjdump not found")
def test_update_kernel_counts_by_class_and_source():
    """benchmarks/parts/update_sass.py (bench_forge.py --part sass) compiles the update kernel as the
    launcher configures it and splits its main path by instruction class and by source function:
    the classes add up to the path, the 8-bit state's codec shows up where the bf16 states have none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from parts import update_sass as u; "
            "print(json.dumps([u.analyse(s) for s in ('bf16', 'int8')]))")
    root = os.path.join(HERE, "..")
    env["PYTHONPATH"] = os.path.join(root, "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         check=True, cwd=root).stdout
    import json

    bf16, int8 = json.loads(out.splitlines()[-1])
    for r in (bf16, int8):
        assert sum(v for k, v in r["per_thread"].items() if k not in ("main", "total")) == r["per_thread"]["main"]
        assert r["registers"] > 0 and r["spill_bytes"] == 0
    assert int8["tile"] == {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2}  # the launcher's 8-bit tile
    assert int8["functions_per_element"].get("state8.py:_lines", 0) > 0
    assert "state8.py:_lines" not in bf16["functions_per_element"]
    assert int8["per_element"]["global_load"] > bf16["per_element"]["global_load"]  # the map's gathers
