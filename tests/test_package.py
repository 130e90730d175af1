"""The package surface: every advertised name resolves, and importing the package stays cheap."""

import ast
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

import lightning_bpk

from conftest import run_process


@pytest.mark.parametrize("name", lightning_bpk.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    assert getattr(lightning_bpk, name) is not None
    assert name in dir(lightning_bpk)


def test_lazy_exports_and_type_checking_imports_match_all() -> None:
    """``__all__`` is a literal (for type checkers and the API docs), and the names the lazy
    ``__getattr__`` serves are exactly the ones type checkers see through ``TYPE_CHECKING``."""
    assert sorted(lightning_bpk._EXPORTS) == sorted(lightning_bpk.__all__)
    tree = ast.parse(Path(lightning_bpk.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n))
    imported = {alias.asname or alias.name for node in guarded.body for alias in node.names}
    assert imported == set(lightning_bpk.__all__)


def _modules() -> list[str]:
    return ["lightning_bpk"] + [
        m.name for m in pkgutil.walk_packages(lightning_bpk.__path__, "lightning_bpk.")
    ]


@pytest.mark.parametrize("name", _modules())
def test_every_module_says_what_is_public(name: str) -> None:
    """``__all__`` in every module; every function and class a module defines is either in it
    or private (a leading underscore)."""
    module = importlib.import_module(name)
    assert isinstance(module.__dict__.get("__all__"), list), f"{name} has no __all__"
    assert all(hasattr(module, n) for n in module.__all__), name
    defined = [
        n
        for n, obj in vars(module).items()
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name
    ]
    unlisted = [n for n in defined if not n.startswith("_") and n not in module.__all__]
    assert not unlisted, f"{name}: public but not in __all__ (make them private?): {unlisted}"


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lightning_bpk.nope


def test_import_does_not_load_torch_or_lightning() -> None:
    code = "import sys, lightning_bpk; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    out = run_process([sys.executable, "-c", code], check=True)
    assert out.stdout.strip() == "[]"


def test_py_typed_marker_ships() -> None:
    from importlib.resources import files

    assert files("lightning_bpk").joinpath("py.typed").is_file()


def test_make_test_runs_the_docstring_examples(pytestconfig: pytest.Config) -> None:
    """Every ``>>>`` line in the package is a test: ``pytest`` (``make test``) collects
    ``lightning_bpk`` with ``--doctest-modules``."""
    assert "lightning_bpk" in pytestconfig.getini("testpaths")
    assert "--doctest-modules" in pytestconfig.getini("addopts")
