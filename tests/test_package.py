"""The package surface: every advertised name resolves, and importing the package stays cheap."""

import sys

import pytest

import lightning_bpk

from conftest import run_process


@pytest.mark.parametrize("name", lightning_bpk.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    assert getattr(lightning_bpk, name) is not None
    assert name in dir(lightning_bpk)


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
