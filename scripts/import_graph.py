"""The import graph of ``transport``: modules, layers, edges, and every import that makes it not a
one-way stack (a cycle, or an import from a lower layer up to a higher one).

Every import counts: top-level, inside a function (lazy), and under ``TYPE_CHECKING``. A lazy or
type-only import that points up is the same dependency as a top-level one; it only hides the
cycle from the interpreter. A package's ``__init__`` importing its own submodules (re-exports) is
not a dependency of those submodules on the package and is left out.

Layers: a module with no internal import is layer 0; any other is one above the highest module it
imports. They are defined only when the graph is acyclic, so with a cycle the tool reports the
cycle's members and the edges that close it (an edge u -> v is "upward" when v reaches u).

    python scripts/import_graph.py           # summary; exit 1 on a cycle
    python scripts/import_graph.py --edges   # also every edge, by layer

Run by scripts/lint.sh; tests/api/test_exports.py asserts the graph is acyclic.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "transport"


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package of ``pkg``."""
    out = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path) -> set[str]:
    """Absolute dotted names ``module`` imports anywhere in its source (relative ones resolved).

    ``from a import b`` yields ``a`` and ``a.b``; the caller keeps the ones that are modules.
    """
    tree = ast.parse(path.read_text())
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = ".".join(base[: len(base) - node.level + 1])
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the internal modules it imports (all imports; own re-exports excluded)."""
    mods = modules(pkg)
    out: dict[str, set[str]] = {}
    for m, p in mods.items():
        deps = {name for name in imported_names(m, p) if name in mods}  # `from a import b` names a too
        is_pkg = p.name == "__init__.py"
        deps = {d for d in deps if d != m and not (is_pkg and d.startswith(m + "."))}
        out[m] = deps
    return out


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles as its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
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
                comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return comps


def layers(g: dict[str, set[str]]) -> dict[str, int]:
    """Module -> layer (0 imports nothing internal). Only for an acyclic graph."""
    out: dict[str, int] = {}

    def layer(v: str) -> int:
        if v not in out:
            out[v] = 1 + max((layer(w) for w in g[v]), default=-1)
        return out[v]

    for v in g:
        layer(v)
    return out


def folded(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with every subpackage of ``transport`` as one node (``transport.weights``,
    ``transport.backends``, ``transport._transfers``, ...): the view in which a package is a
    layer, so that a module below importing any part of it counts as an import up."""
    def node(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, deps in g.items():
        out.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    return out


def report(g: dict[str, set[str]], what: str) -> tuple[str, list[str]]:
    """One line of counts for ``g``, and the lines describing each cycle (none when acyclic)."""
    n_edges = sum(len(d) for d in g.values())
    cycles = strongly_connected(g)
    if not cycles:
        return f"{len(g)} {what}, {max(layers(g).values()) + 1} layers, {n_edges} edges, no cycle", []
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"cycle among {len(comp)} {what}; edges inside it: "
                     + "; ".join(sorted(f"{u} -> {v}" for u in comp for v in g[u] if v in members)))
    return f"{len(g)} {what}, {n_edges} edges, {len(cycles)} cycle(s)", lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every edge, by layer")
    args = ap.parse_args(argv)
    g = graph()
    rc = 0
    for view, what in ((g, "modules"), (folded(g), "modules and folders")):
        line, cycles = report(view, what)
        print(f"import graph: {line}")
        for c in cycles:
            print(f"  {c}")
        rc |= bool(cycles)
    if args.edges and not rc:
        lay = layers(g)
        for m in sorted(g, key=lambda v: (lay[v], v)):
            print(f"  [{lay[m]:2d}] {m} -> {', '.join(sorted(g[m])) or '-'}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
