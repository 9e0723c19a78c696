"""The benchmarks (``benchmarks/``) and examples (``examples/``) use only the public
``transport`` API: no code outside ``transport/`` imports a ``transport._*`` module or a private
name (tests of internals aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])


# Modules of transport that are public API (DESIGN.md); everything else in the package is internal.
PUBLIC_MODULES = {"transport", "transport.weights", "transport.testing", "transport.backends", "transport.plan",
                  "transport.vllm"}


# The few that measure an internal part itself, which has no public face, and the private
# modules each may import: nothing else. Each entry must still be used (see the test).
INTERNAL_BENCHMARKS = {
    # The diff kernel alone, with no Python between its calls (the delta sync target's floor).
    "benchmarks/delta_kernel/__main__.py": {"transport._native.delta"},
}


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of this checkout (else an attribute of one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _is_private(name: str) -> bool:
    """Whether importing ``name`` (a module, or ``module.attribute``) reaches past the public API."""
    if name.split(".")[0] != "transport":
        return False
    if _is_module(name):
        return name not in PUBLIC_MODULES
    parent, _, last = name.rpartition(".")
    return parent not in PUBLIC_MODULES or (last.startswith("_") and not last.startswith("__"))


def _private_imports(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every import in ``path`` that reaches into ``transport`` past its public API."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, name) for name in names if _is_private(name)]
    return out


def test_the_check_tells_public_from_private() -> None:
    for name in ("transport", "transport.Transport", "transport.__version__", "transport.weights.Publisher"):
        assert not _is_private(name), name
    for name in ("transport.backends", "transport.backends.Backend", "transport.testing.check_backend"):
        assert not _is_private(name), name
    for name in ("transport._cuda", "transport._native.load", "transport.backends._base", "transport._rendezvous"):
        assert _is_private(name), name


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_import_only_public_transport_names(path: Path) -> None:
    relative = str(path.relative_to(ROOT))
    allowed = INTERNAL_BENCHMARKS.get(relative, set())
    imported = _private_imports(path)
    bad = [f"{relative}:{lineno}: {name}" for lineno, name in imported if name not in allowed]
    assert not bad, "private transport modules imported:\n" + "\n".join(bad)
    unused = allowed - {name for _, name in imported}
    assert not unused, f"{relative} is allowed {sorted(unused)} but no longer imports them: drop the entry"


def test_every_internal_benchmark_named_exists() -> None:
    missing = [p for p in INTERNAL_BENCHMARKS if not (ROOT / p).is_file()]
    assert not missing, f"INTERNAL_BENCHMARKS names files that are gone: {missing}"
