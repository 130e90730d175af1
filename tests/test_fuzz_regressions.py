"""Every input the loader fuzzer (``tests/fuzz/fuzz_loaders.py``) found a bug with, kept under
``tests/fixtures/fuzz/<target>/<kind>/`` and replayed through the same target and oracle
(``tests/fuzz/loaders.py``): each must now load or raise the package's own error, and one that
flips checksummed tensor data (``corrupted``) must be refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES
from fuzz.loaders import TARGETS, check

CASES = sorted((FIXTURES / "fuzz").glob("*/*/*.bin"))


def test_every_kept_input_names_a_target_and_a_kind() -> None:
    assert CASES, "the fuzzer's findings are kept as regression inputs"
    for path in CASES:
        assert path.parts[-3] in TARGETS and path.parts[-2] in ("hostile", "corrupted"), path


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parts[-3]}-{p.parts[-2]}-{p.stem}")
def test_a_fuzzer_finding_stays_fixed(path: Path, tmp_path: Path) -> None:
    target, kind = path.parts[-3], path.parts[-2]
    check(target, path.read_bytes(), tmp_path, corrupted=kind == "corrupted")
