"""The wheel a user installs: built from this checkout, it carries the license, the metadata an
index shows, the package's gin configurations and nothing of the test rig; installed on its own
(no file of the checkout on the path), it trains the digits example with its shipped gin file.

The wheel is built without build isolation (setuptools comes from the venv, no download) and
installed without its dependencies into a folder of its own, which comes first on the path: the
package runs from the wheel's files, its dependencies from the venv. A fresh venv with
``pip install <wheel>`` and every dependency takes minutes; that was done by hand for the issue
that added this test.
"""

from __future__ import annotations

import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT, run_process

TIMEOUT_S = 600


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = run_process(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", ROOT, "-w", out],
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (found,) = out.glob("lightning_bpk-*.whl")
    return found


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_the_wheel_carries_license_metadata_and_gin_files_and_no_test_rig(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in z.read(license_file).decode()
    shipped = {Path(n).name for n in names if n.startswith("lightning_bpk/gin/")}
    assert shipped == {p.name for p in (ROOT / "lightning_bpk" / "gin").glob("*.gin")}
    assert "lightning_bpk/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)
    assert sorted(meta.get_all("Provides-Extra") or []) == ["gcs", "s3"]  # no dev extra
    for requirement in meta.get_all("Requires-Dist") or []:
        if "extra ==" not in requirement:
            assert ">=" in requirement and "==" not in requirement, requirement  # loose ranges


def test_the_installed_wheel_trains_the_example_with_its_shipped_gin_file(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    install = run_process(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--target", site, wheel],
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    gin_file = site / "lightning_bpk" / "gin" / "digits.gin"
    assert gin_file.is_file()
    run = run_process(
        [sys.executable, EXAMPLES / "train_digits.py", "--base_dir", tmp_path / "run",
         "--gin_file", gin_file, "--gin_binding", "train.max_epochs = 1"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "saved checkpoint 0" in run.stderr
    assert (tmp_path / "run" / "checkpoints" / "sentinel_checkpoint_complete.0").is_file()
    where = subprocess.run(
        [sys.executable, "-c", "import lightning_bpk; print(lightning_bpk.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(site))  # the wheel's files, not the checkout's
