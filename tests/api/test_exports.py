"""Guards the public surface and the package's shape.

* the public names (``transport``, ``transport.weights``, ``transport.testing``) and the
  public methods of ``Transport`` are exactly the documented ones (README "Public API");
* public names report ``transport`` (or ``transport.backends``, public for backend authors) as
  their module, never a private one;
* layering: no import cycle among ``transport`` modules or folders, lazy and type-only imports
  included (scripts/import_graph.py), only ``transport._native`` touches the
  extension or ctypes, and nothing outside ``transport/`` imports a private module (tests of
  internals excepted);
* size: ``Transport`` is one class of at most 550 lines (500 until the prepared-transfer API added four
  delegating methods; most of it is docstrings), and no module exceeds 600 lines.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import transport
import transport._errors
import transport.plan
import transport.testing
import transport.weights

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "transport"

PUBLIC = {
    "Transport", "Transfer", "PreparedTransfer", "TransferOp", "gather", "Peer", "Region", "serve_store",
    "register_backend", "available_backends", "cuda_unavailable_reason",
    "TransportError", "ClosedError", "PeerLostError", "TransferTimeoutError", "TransferAbortedError",
    "RegistrationError", "ReadOnlyRegionError", "BoundsError", "DTypeMismatchError", "LayoutError",
    "BackendUnavailableError", "PeerNotFoundError", "AuthenticationError", "StoreError", "TransportInternalError",
    "RecordTooLargeError", "WireError",
}
TRANSPORT_METHODS = {
    "aclose", "register", "register_many", "unregister", "empty", "regions", "put", "get", "fence",
    "signal", "signal_value", "wait_signal", "peer", "lookup", "peers", "exclude", "dump_flight_record",
    "flight_record", "backends", "store_url", "prepare_put", "prepare_get", "put_many", "get_many",
    "prepare_put_runs", "prepare_get_runs",
}
WEIGHTS = {"Publisher", "Subscriber", "SyncStatus", "SyncResult", "PublishReport", "LayoutMismatchError",
           "MeshPublisher", "MeshPublishReport", "MeshSubscriber", "CommitError", "DeltaRefusedError"}
PLAN = {"TrainerLayout", "TensorSpec", "MeshSharding", "ExplicitSharding", "Shard", "Replicate", "Replica",
        "GeneratorRank", "LocalTensor", "Piece", "Planner", "Plan", "ReplicaPlan", "RankPlan", "Move", "Topology",
        "MeshLayoutError", "trainer_layout", "generator_rank", "generator_replica", "model_config", "builtin_model",
        "trainer_layout_from_state_dict", "merge_trainer_layouts"}


def test_public_names_are_exactly_the_documented_ones() -> None:
    assert set(transport.__all__) == PUBLIC
    for name in transport.__all__:
        assert hasattr(transport, name), name


def test_public_names_report_a_public_module() -> None:
    for name in transport.__all__:
        module = getattr(transport, name).__module__
        assert module in ("transport", "transport.backends"), (name, module)


def test_transport_methods_are_exactly_the_documented_ones() -> None:
    public = {n for n, _ in inspect.getmembers(transport.Transport) if not n.startswith("_")}
    assert public == TRANSPORT_METHODS


def test_every_public_method_has_a_docstring() -> None:
    for name in TRANSPORT_METHODS:
        assert inspect.getdoc(getattr(transport.Transport, name)), name


def test_weights_plan_and_testing_exports() -> None:
    assert WEIGHTS <= set(transport.weights.__all__)
    assert PLAN <= set(transport.plan.__all__)
    for name in transport.plan.__all__:
        obj = getattr(transport.plan, name)
        if (isinstance(obj, type) and obj.__module__ != "builtins") or inspect.isfunction(obj):  # not aliases
            assert obj.__module__ == "transport.plan", (name, obj.__module__)
    assert {"check_backend"} <= set(transport.testing.__all__)


@functools.cache
def _import_graph() -> ModuleType:
    """scripts/import_graph.py: the package's modules and what each imports (lazy and type-only
    imports included)."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules() -> dict[str, Path]:
    return dict(_import_graph().modules(PKG))


def test_no_import_cycle_among_transport_modules_or_folders() -> None:
    """Every import counts (top-level, lazy, under TYPE_CHECKING): a lazy or type-only import
    that closes a cycle is the same dependency, hidden from the interpreter. And with each
    subpackage as one node, no module below a package imports any part of it."""
    ig = _import_graph()
    graph = ig.graph()
    assert {"transport._transfers.engine", "transport.backends.ipc"} <= graph.keys()  # it sees the tree
    assert "transport._errors" in graph["transport._transfers.engine"]
    for view, what in ((graph, "modules"), (ig.folded(graph), "modules and folders")):
        _line, cycles = ig.report(view, what)
        assert cycles == [], cycles


def test_the_import_graph_check_finds_a_type_only_cycle(tmp_path: Path) -> None:
    """The check is not blind to the kind of cycle it exists for: two modules that import each
    other, one of them only under TYPE_CHECKING."""
    ig = _import_graph()
    pkg = tmp_path / "transport"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import B\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.a import A\n")
    graph = ig.graph(pkg)
    assert graph["transport.sub.a"] == {"transport.b"} and graph["transport.b"] == {"transport.sub.a"}
    _line, cycles = ig.report(graph, "modules")
    assert len(cycles) == 1 and "transport.b -> transport.sub.a" in cycles[0]
    _line, cycles = ig.report(ig.folded(graph), "modules and folders")
    assert len(cycles) == 1 and "transport.sub -> transport.b" in cycles[0]


def test_only_native_touches_the_extension_and_ctypes() -> None:
    offenders = []
    for m, p in _modules().items():
        if m.startswith("transport._native"):
            continue
        names = _import_graph().imported_names(m, p)
        if "ctypes" in names or any(n == "transport._C" or n.startswith("transport._C.") for n in names):
            offenders.append(m)
    assert not offenders
    assert (PKG / "_native" / "_C.pyi").is_file()


def test_transport_is_one_class_without_mixins() -> None:
    """(Module and class sizes are an alarm in the lint step, scripts/module_sizes.py.)"""
    assert transport.Transport.__mro__[1:] == (object,), "no mixins"


def _readme_error_tree() -> dict[str, str | None]:
    """The error tree drawn in the README: class name -> parent name (None for the root)."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("Errors form one tree"):]
    block = block[block.index("```\n") + 4:]
    block = block[: block.index("```")]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        m = re.match(r"^([\s│├└─]*)(\w+)", line)
        assert m, line
        depth, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


INTERNAL_ERRORS = {"MalformedLayoutError", "MalformedRegionError", "CudaError"}  # drawn as their parents


def test_readme_draws_every_public_error_with_its_real_parent() -> None:
    tree = _readme_error_tree()
    errors = {n: getattr(transport._errors, n) for n in transport._errors.__all__ if n not in INTERNAL_ERRORS}
    assert set(tree) == set(errors), set(tree) ^ set(errors)
    # Each is exported by the package it belongs to (transport.vllm by its source: importing it needs vLLM).
    vllm_init = (PKG / "vllm" / "__init__.py").read_text()
    for name, cls in errors.items():
        homes = [m for m in (transport, transport.weights, transport.plan) if getattr(m, name, None) is cls]
        assert homes or f"import {name} as {name}" in vllm_init, name
    for name, parent in tree.items():
        cls = errors[name]
        if parent is None:
            assert cls is transport.TransportError
        else:
            assert cls.__bases__[0] is errors[parent], (name, parent, cls.__bases__)


def test_every_error_class_is_defined_in_the_error_module() -> None:
    """One tree in one module: outside transport/_errors.py a class deriving from an error of
    the tree is private (a leading underscore), so everything users may catch is drawn there."""
    tree_names = set(transport._errors.__all__)
    offenders = []
    for m, path in _modules().items():
        if m == "transport._errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                if bases & tree_names:
                    offenders.append(f"{m}.{node.name}")
    assert offenders == []


def test_only_the_codec_reaches_the_native_delta_module() -> None:
    """Weight sync's delta code is one codec (transport/weights/_codec/): its drivers (the
    publishers, the subscribers, the vLLM worker) go through it, never to the native pass."""
    ig = _import_graph()
    outside = [m for m, p in _modules().items()
               if m.startswith(("transport.weights", "transport.vllm")) and not m.startswith("transport.weights._codec")
               and "transport._native.delta" in ig.imported_names(m, p)]
    assert outside == []
