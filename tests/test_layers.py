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
# the checkpointer, then the integrations; interop and the CLI sit beside those they use.
LAYERS = {
    # primitives: errors, durable files, device copies, gin, the on-disk name grammar
    "errors": 0,
    "_fs": 0,
    "_device": 0,
    "_gin": 0,
    "layout": 0,
    # where the bytes go
    "store": 1,
    "storage": 1,
    "_sharded_names": 1,
    # the format
    "burnpack": 2,
    # the state codec
    "state": 3,
    # records and the manifest that lists them
    "records": 4,
    "manifest": 4,
    # one checkpoint: read, verified, committed, collected (DCP over the same store)
    "lease": 5,
    "_checkpoint": 5,
    "_commit": 5,
    "checkpointer": 5,
    "_sharded_index": 5,
    "dcp": 5,
    # interop: other frameworks' files, over records and DCP
    "interop": 6,
    # Lightning (and the old top-level module names, which re-export it)
    "lightning": 7,
    "async_save": 7,
    "callback": 7,
    "checkpoint_io": 7,
    "data_position": 7,
    "sharded": 7,
    "slurm": 7,
    "trainer_state": 7,
    # Fabric, which shares the Lightning layer's loaders, sharded glue and async saver
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


def _imports(name: str, source: str | None = None) -> Iterator[str]:
    """The package's modules that module ``name`` imports (a name imported from a package is
    the package, unless the name is one of its modules); ``source``: its text, if not the
    file's."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
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


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components of the import graph: none has two modules."""
    graph = {name: set(_imports(name)) for name in MODULES}
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
