"""The import graph of ``src/leantrain`` runs one way (ops -> optim -> model, runtime -> techniques ->
train -> cli) and the kernels of ``ops`` import each other without a cycle.

Every ``import`` / ``from ... import`` of every module is read with :mod:`ast`, the ones inside
functions included (a lazy import is still a dependency), and ``importlib.import_module("leantrain...")``
with a literal name too. ``from package import name`` is an edge to ``package.name`` when that is a
module, else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "leantrain"

CORE = {"ops", "optim", "model", "runtime", "config", "data", "technique"}  # never import a technique, train or cli
TECHNIQUES = {"forge", "agoq", "comm", "parallel", "finetune"}  # never import another technique, train or cli
TOP = {"train", "cli"}
TECHNIQUE_EDGES_ALLOWED = {("parallel", "comm")}

# Known violations (importer, imported), none today; an entry must be removed once its edge is gone.
ALLOWED_FOR_NOW: set[tuple[str, str]] = set()


def _modules(src: Path = SRC) -> dict[str, Path]:
    mods = {}
    for path in (src / ROOT).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(importer: str, is_pkg: bool, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = importer.split(".") if is_pkg else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _edges(mods: dict[str, Path]) -> set[tuple[str, str]]:
    edges = set()
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                targets = [node.args[0].value]
            for t in targets:
                while t and t not in mods:  # import a.b.c of a name: its longest module prefix
                    t = t.rpartition(".")[0]
                if t.startswith(ROOT + ".") and t != name:
                    edges.add((name, t))
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _forbidden(importer: str, imported: str) -> bool:
    a, b = _package(importer), _package(imported)
    if a == b or not a or not b:
        return False
    if a in CORE:
        return b in TECHNIQUES or b in TOP
    if a in TECHNIQUES:
        return (b in TECHNIQUES and (a, b) not in TECHNIQUE_EDGES_ALLOWED) or b in TOP
    return False


def test_no_forbidden_direction():
    edges = _edges(_modules())
    bad = {(a, b) for a, b in edges if _forbidden(a, b)}
    assert bad <= ALLOWED_FOR_NOW, f"imports against the layering: {sorted(bad - ALLOWED_FOR_NOW)}"
    stale = {e for e in ALLOWED_FOR_NOW if e not in bad}
    assert not stale, f"fixed, remove from ALLOWED_FOR_NOW: {sorted(stale)}"


def _cycles(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        if a in nodes and b in nodes:
            succ[a].append(b)
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_ops_has_no_import_cycle():
    mods = _modules()
    ops = {m for m in mods if m == f"{ROOT}.ops" or m.startswith(f"{ROOT}.ops.")}
    assert not _cycles(ops, _edges(mods))


def test_ops_imports_only_ops():
    """The kernels are the bottom layer: nothing of leantrain outside ops."""
    edges = _edges(_modules())
    assert not {(a, b) for a, b in edges if _package(a) == "ops" and _package(b) != "ops"}


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Imports inside functions, relative imports, ``from package import module`` and
    ``importlib.import_module`` with a literal name are all edges."""
    pkg = tmp_path / ROOT
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "b" / "x.py").write_text("")
    (pkg / "b" / "y.py").write_text("")
    (pkg / "b" / "z.py").write_text("")
    (pkg / "a" / "m.py").write_text(
        "import importlib\n"
        "def f():\n    from leantrain.b import x\n"
        "def g():\n    from ..b.y import name\n"
        "def h():\n    return importlib.import_module('leantrain.b.z')\n")
    edges = _edges(_modules(tmp_path))
    assert {(f"{ROOT}.a.m", f"{ROOT}.b.{m}") for m in "xyz"} <= edges


def test_no_cycle_anywhere():
    """No cycle in the whole module graph, and none between the packages (a package's modules
    taken as one node; the root package ``leantrain`` itself, which only re-exports, left out)."""
    mods = _modules()
    edges = _edges(mods)
    assert not _cycles(set(mods), edges), _cycles(set(mods), edges)
    pkgs = {(_package(a), _package(b)) for a, b in edges if _package(a) and _package(b) and _package(a) != _package(b)}
    nodes = {x for e in pkgs for x in e}
    assert not _cycles(nodes, pkgs), f"package cycles: {_cycles(nodes, pkgs)}"
