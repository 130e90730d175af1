"""The package's layers, pinned: every import (module level or inside a function) goes to the
same layer or one below, and no two modules import each other, directly or around a circle.

An import that climbs means the design is wrong (a lower layer would need the upper one to be
understood or tested); this test names the importing module and what it imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_bpk"

# The top-level module or package under lightning_bpk -> its layer (a module may import its own
# layer and those below). Bottom to top: bytes on disk, the format, the state codec, records,
# the checkpointer, the run layer, then the two integrations beside each other; interop and the
# CLI sit beside those they use.
LAYERS = {
    # primitives: errors, durable files, device copies, nested data copied, gin, the on-disk
    # name grammar
    "errors": 0,
    "_fs": 0,
    "_device": 0,
    "_nested": 0,
    "_gin": 0,
    "layout": 0,
    # where the bytes go, and the lease that makes one run own a directory
    "store": 1,
    # the format
    "burnpack": 2,
    # the state codec
    "state": 3,
    # records
    "records": 4,
    # one checkpoint: read, verified, committed, collected, and its manifest; DCP over the
    # same store, with the sharded index
    "checkpointer": 5,
    "dcp": 5,
    # interop: other frameworks' files, over records and DCP
    "interop": 6,
    # the run layer: resume policy, save and agree, sharded save, async saver, cadence,
    # preemption, loader positions, RNG states; framework-free, under both integrations
    "runtime": 7,
    # the integrations, siblings over the run layer: neither imports the other
    "lightning": 8,
    "fabric": 8,
    # the command line and the package's own entry points
    "cli": 9,
    "__main__": 9,
    "__init__": 9,
}


def _modules() -> dict[str, Path]:
    """``lightning_bpk.x.y`` -> its file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks: imports for type checkers,
    which never run (a package's lazy ``__getattr__`` names its submodules that way)."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}
        for statement in node.body
        for inner in ast.walk(statement)
    }


def _imports(name: str, source: str | None = None, *, running: bool = False) -> Iterator[str]:
    """The package's modules that module ``name`` imports (a name imported from a package is
    the package, unless the name is one of its modules); ``source``: its text, if not the
    file's; ``running``: only the imports that run (not those for type checkers)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source)
    skipped = _type_only(tree) if running else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]  # a name inside a module: the module
            if target.startswith("lightning_bpk") and target != name:
                yield target


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(LAYERS))
    assert not unplaced, f"give these a layer in tests/test_layers.py: {unplaced}"


def _climbs(name: str, source: str | None = None) -> list[str]:
    return sorted(t for t in set(_imports(name, source)) if _layer(t) > _layer(name))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_climbs_a_layer(name: str) -> None:
    climbs = _climbs(name)
    assert not climbs, f"{name} (layer {_layer(name)}) imports {climbs} from above it"


def _framework_imports(name: str, source: str | None = None) -> list[str]:
    """The modules of the ``lightning`` framework package that module ``name`` imports (module
    level or inside a function, type checkers' imports too); ``source``: its text, if not the
    file's."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "lightning"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [node.module] if node.module.split(".")[0] == "lightning" else []
    return sorted(found)


def _package(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _package(m) == "runtime"))
def test_the_run_layer_is_framework_free(name: str) -> None:
    """The run layer imports neither integration, and never the ``lightning`` package."""
    integrations = sorted(t for t in set(_imports(name)) if _package(t) in {"lightning", "fabric"})
    assert not integrations, f"{name} imports the integrations {integrations}"
    assert not _framework_imports(name), f"{name} imports {_framework_imports(name)}"


@pytest.mark.parametrize(("package", "sibling"), [("fabric", "lightning"), ("lightning", "fabric")])
def test_the_integrations_are_siblings(package: str, sibling: str) -> None:
    """Fabric imports nothing from ``lightning_bpk.lightning``, and the callback's package
    nothing from ``lightning_bpk.fabric``: what both need lives in the run layer below."""
    found = {
        name: sorted(t for t in set(_imports(name)) if _package(t) == sibling)
        for name in MODULES
        if _package(name) == package
    }
    assert not {k: v for k, v in found.items() if v}, f"{package} imports {sibling}: {found}"


def test_a_framework_import_is_caught() -> None:
    """The framework check sees ``lightning`` imports at module level and in functions, and
    not ``lightning_bpk``'s own."""
    source = """
import lightning.pytorch as pl
from lightning_bpk import errors
def later():
    from lightning.fabric import Fabric
"""
    found = _framework_imports("lightning_bpk.runtime.ranks", source)
    assert found == ["lightning.fabric", "lightning.pytorch"]


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components of the graph of imports that run: none has two
    modules."""
    graph = {name: set(_imports(name, running=True)) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, f"modules that import each other: {cycles}"


def test_a_climb_is_caught() -> None:
    """The check itself finds climbing imports, at module level, inside a function and
    relative, and lets the ones going down pass."""
    source = """
from lightning_bpk import _fs
from .. import errors
def later():
    from lightning_bpk.checkpointer import Checkpointer
    from ..lightning.callback import BurnpackCheckpoint
"""
    assert _climbs("lightning_bpk.store.local", source) == [
        "lightning_bpk.checkpointer",
        "lightning_bpk.lightning.callback",
    ]
    assert set(_imports("lightning_bpk.store.local", source)) == {
        "lightning_bpk._fs",
        "lightning_bpk.errors",
        "lightning_bpk.checkpointer",
        "lightning_bpk.lightning.callback",
    }


def test_type_checking_imports_climb_but_close_no_cycle() -> None:
    """An import for type checkers counts against the layers (it still couples the modules)
    but not for cycles (it never runs)."""
    source = """
from typing import TYPE_CHECKING
from lightning_bpk import errors
if TYPE_CHECKING:
    from lightning_bpk.checkpointer import Checkpointer
"""
    assert _climbs("lightning_bpk.store.local", source) == ["lightning_bpk.checkpointer"]
    assert set(_imports("lightning_bpk.store.local", source, running=True)) == {
        "lightning_bpk.errors"
    }
