"""The package surface: every advertised name resolves, and importing the package stays cheap."""

import ast
import importlib
import inspect
import logging
import pkgutil
import sys
import textwrap
from pathlib import Path

import gin
import pytest

import lightning_bpk
from lightning_bpk import _gin

from conftest import Finished, run_process


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


def _is_private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


@pytest.mark.parametrize("name", [m for m in _modules() if not _is_private(m)])
def test_every_module_says_what_is_public(name: str) -> None:
    """``__all__`` lists what users call; the rest has a leading underscore: every public
    module has an ``__all__``, and every function and class it defines is in it or private.
    A private module (``_commit``, ``dcp._writer``) is internal whole, its names included."""
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


def _python(code: str, *args: str, cwd: Path | None = None) -> Finished:
    """Run ``code`` in a fresh interpreter (nothing imported, no logging configured)."""
    return run_process([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd)


def test_gin_bindings_work_after_a_plain_import(tmp_path: Path) -> None:
    out = _python(
        """
        import sys, gin, lightning_bpk
        print(sorted({"torch", "lightning"} & set(sys.modules)))
        gin.parse_config(
            "get_latest_checkpoint_number.override_number = 2\\n"
            "Checkpointer.checkpoint_duration = 7"
        )
        from lightning_bpk.checkpointer import get_latest_checkpoint_number
        print(get_latest_checkpoint_number("/does/not/exist"))
        print(lightning_bpk.Checkpointer("c").checkpoint_duration)
        """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "2", "7"]


def test_every_configurable_has_a_stand_in_under_its_real_selector() -> None:
    import lightning_bpk.lightning.callback  # noqa: F401  (every configurable is now registered for real)

    for selector, module in _gin.CONFIGURABLES.items():
        real = getattr(importlib.import_module(module), selector.rpartition(".")[2])
        assert gin.get_configurable(selector) is real


@gin.configurable
def make_things(things: list = ()) -> list:
    return list(things)


def test_a_stand_in_imports_its_module_when_gin_needs_it(tmp_path: Path, monkeypatch) -> None:
    """A class, referenced and bound before its (here: fresh) module is imported."""
    (tmp_path / "lazily_defined.py").write_text(
        "from lightning_bpk import _gin\n\n"
        '@_gin.configurable("lazily_defined")\n'
        "class Thing:\n"
        '    def __init__(self, size=1, name="x"):\n'
        "        self.size, self.name = size, name\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _gin.register_stand_ins({"lazily_defined.Thing": "lazily_defined"})
    try:
        gin.parse_config("make_things.things = [@lazily_defined.Thing()]")
        assert "lazily_defined" not in sys.modules  # a reference needs nothing yet
        gin.parse_config("Thing.size = 3")  # checking the parameter imports the module
        assert "lazily_defined" in sys.modules
        with pytest.raises(ValueError, match="doesn't have a parameter named 'sise'"):
            gin.parse_config("Thing.sise = 3")
        (thing,) = make_things()
        assert (type(thing).__module__, thing.size, thing.name) == ("lazily_defined", 3, "x")
    finally:
        gin.clear_config()
        sys.modules.pop("lazily_defined", None)


def test_our_log_lines_show_without_a_logging_configuration() -> None:
    """As Lightning's own do: INFO lines of the ``lightning_bpk`` logger (the callback's) reach
    stderr when the program configures no logging; once it does (before or after the import),
    they go through that configuration, once."""
    import lightning_bpk.lightning.callback

    assert lightning_bpk.lightning.callback.log is logging.getLogger("lightning_bpk")
    code = """
        import logging, sys
        if sys.argv[1] == "before":
            logging.basicConfig(format="root: %(message)s")
        import lightning_bpk
        if sys.argv[1] == "after":
            logging.basicConfig(format="root: %(message)s")
        logging.getLogger("lightning_bpk").info("saved checkpoint 0 at x")
    """
    for when, prefix in (("never", "lightning_bpk: "), ("before", "root: "), ("after", "root: ")):
        assert _python(code, when).stderr == prefix + "saved checkpoint 0 at x\n"
