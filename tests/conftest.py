"""What the whole suite shares: the committed fixtures, ``tests/scripts`` on the import path, one
way to run a subprocess, and the uninterrupted reference runs that several test files compare
their interrupted runs against (each run once per session).

Test modules import these names directly (``from conftest import MNIST_BPK, run_process``):
pytest has already imported this file as the module ``conftest`` before it collects them.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_bpk.checkpointer import Checkpointer, CheckpointWarning, choose_resume
from lightning_bpk.records.base import RecordError
from lightning_bpk.store import object_store

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPTS = TESTS / "scripts"
EXAMPLES = ROOT / "examples"
FIXTURES = TESTS / "fixtures"
# Burn's own MNIST model (see tests/fixtures/README.md): the one file no code of ours wrote.
MNIST_BPK = FIXTURES / "burn" / "mnist-model.bpk"
# The test libraries only this process imports (transformers 5, MLflow; `make test` installs
# them there), appended to its path here and never to a training subprocess's: torchmetrics,
# which Lightning imports, would import them (and scipy, matplotlib) in every one (Makefile).
SLOW_IMPORTS = ROOT / ".venv-slow-imports"
site.addsitedir(str(SLOW_IMPORTS))

# The fuzz harness needs atheris, which the suite does not install; --doctest-modules would
# import it (tests/scripts import fine: they only run when started as scripts).
collect_ignore = ["fuzz"]

# The helper scripts (lightning_tiny, crash_saver) are both run as scripts and imported by tests.
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


@dataclass(frozen=True)
class Finished:
    """A subprocess that ran to its end (or was killed): what ``run_process`` returns."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    pid: int


def start_process(
    command: Sequence[object],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
) -> subprocess.Popen:
    """Start ``command`` in a session of its own (so :func:`finish_process` can kill its whole
    process group), its output captured as text. If the test ends, passed or failed, with the
    process still running, :func:`_no_process_outlives_its_test` kills its group."""
    process = subprocess.Popen(
        [str(part) for part in command],
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )
    _STARTED.append(process)
    return process


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _deterministic_mode_is_the_tests_own() -> Iterator[None]:
    """Put torch's deterministic mode back after each test: a ``Trainer(deterministic=True)``
    turns it on for the whole process and never off, and it changes what later tests of the
    same worker run (``torch.empty`` then fills memory, which some dtypes cannot)."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    """Kill the process group of every process :func:`start_process` started during the test
    and still running at its end: a test that fails between starting a process and finishing
    it (an assertion, an exception) must not leave a training run going after pytest exits."""
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)  # killed: it ends at once; its pipes close with it


def finish_process(
    process: subprocess.Popen, *, timeout: float = 120, check: bool = False
) -> Finished:
    """Wait for a process :func:`start_process` started; a timeout kills its process group and
    fails the test with the tail of stderr, ``check=True`` fails it on a non-zero exit status."""
    args = [str(part) for part in process.args]
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{args} still running after {timeout}s, killed:\n{(err or '')[-3000:]}")
    result = Finished(args, process.returncode, out, err or "", process.pid)
    if check and result.returncode != 0:
        pytest.fail(f"{args} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def import_example(name: str) -> types.ModuleType:
    """``examples/{name}.py`` as a module, imported as running it imports it: with its folder
    first on the path, for the modules the examples share (``digits_data``)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def run_process(
    command: Sequence[object],
    *,
    timeout: float = 120,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
    check: bool = False,
) -> Finished:
    """Run ``command`` to its end and return its exit status and text output.

    It runs in a session of its own, so a timeout kills the whole process group (a Lightning
    DDP run's other ranks, a script's children) and fails the test with the tail of stderr
    instead of hanging the suite. ``stderr`` may be a file descriptor (a pty, say);
    ``check=True`` fails the test on a non-zero exit status.
    """
    process = start_process(command, cwd=cwd, env=env, stderr=stderr)
    return finish_process(process, timeout=timeout, check=check)


# lightning_tiny's uninterrupted reference: every test that compares a killed, stopped or requeued
# run of the same training against it shares this one run (the data order and the weights do not
# depend on where checkpoints go, how often they are saved or how many DataLoader workers fetch).
TINY_SCRIPT = SCRIPTS / "lightning_tiny.py"
TINY_REFERENCE_EPOCHS = 4


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted ``lightning_tiny.py --epochs 4`` run, made once per session (also across
    pytest-xdist workers, which share the folder above their own): ``ref.bpk`` holds its final
    weights, ``ref.ids`` its batches (``epoch batch_idx global_step ids``) and ``ref/checkpoints``
    its end-of-epoch checkpoints."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's base folder sits in the run's one
    root, complete = shared / "tiny-reference", shared / "tiny-reference.complete"
    with open(shared / "tiny-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits for the first one's run
        if not complete.exists():
            shutil.rmtree(root, ignore_errors=True)  # a failed attempt's leftovers
            command = [sys.executable, TINY_SCRIPT, "--root", root / "ref"]
            command += ["--epochs", TINY_REFERENCE_EPOCHS]
            command += ["--ids", root / "ref.ids", "--out", root / "ref.bpk"]
            run_process(command, timeout=120, check=True)
            complete.touch()
    return root


# -- several CPU cores: pytest-xdist ------------------------------------------------------------
# `make test` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`. Most of the suite's time
# is spent in training subprocesses of one process each, which leave the second core idle, and in
# waits on the SLURM controller; two workers fill that time. Each test file is one unit of work
# that one worker runs whole, so a file's module fixtures (the SLURM cluster, the moto server, the
# docs build) start once and its tests keep their order. The slowest files go first, longest
# first (each file's total in a --junitxml run of the suite), so that no worker is left alone
# with one of them at the end. A run without ``-n`` is not affected.
SLOWEST_FILES = (
    "test_e2e_resume.py",
    "test_sharded.py",
    "test_object_storage.py",
    "test_slurm.py",
    "test_examples.py",
    "test_cli_tools.py",
    "test_ddp.py",
    "test_sharded_object_storage.py",
    "test_preemption.py",
    "test_fabric_e2e.py",
    "test_writer.py",
    "test_callback_best.py",
    "test_cli.py",
    "test_callback_rerun.py",
    "test_checkpointer_crash.py",
    "test_fabric_examples.py",
    "test_interop_hub.py",
    "test_dcp.py",
    "test_lightning_cli.py",
    "test_fabric_sharded.py",
    "test_gpu.py",
    "test_data_position.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: leave the run as it is
        return

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

    items.sort(key=rank)  # stable: every file's tests keep their order


def replace_with_symlink(path: Path, elsewhere: Path) -> Path:
    """Move ``path`` (a file or a directory) to ``elsewhere`` and leave a symlink to it in its
    place: the same bytes, reached through a link (what every checkpoint reader must refuse)."""
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere, target_is_directory=elsewhere.is_dir())
    return path


def check_a_50_gib_claim_is_refused(url: str, data: Mapping[str, object]) -> None:
    """Save ``data`` (with a ``model``) as checkpoint 0 in the object store at ``url``, then make
    its manifest claim 50 GiB for model.bpk: loading must refuse it with a RecordError naming the
    object before allocating anything, and resume's choice must skip it."""
    checkpointer = Checkpointer(url)
    checkpointer.save_checkpoint(0, data)
    store = object_store(url)
    manifest = json.loads(store.read("sentinel_checkpoint_complete.0"))
    manifest["files"]["model"]["size"] = 50 * 2**30
    store.put("sentinel_checkpoint_complete.0", json.dumps(manifest).encode())
    claimed = re.escape(f"{url}/ckpt.0/model.bpk: ") + r"\d+ bytes, manifest records 53687091200"
    with pytest.raises(RecordError, match=claimed):
        checkpointer.load_checkpoint(0)
    with pytest.warns(CheckpointWarning, match="manifest records 53687091200"):
        choice = choose_resume(store, "checkpoint", "ckpt", ("model",), 10**9)
        assert (choice.number, choice.data) == (-1, None)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """``tmp_path``, on a filesystem where files are written with ``O_DIRECT`` (skipped, with
    the reason, where the suite's temporary directory has none)."""
    from lightning_bpk import _fs

    fd = os.open(tmp_path / ".probe", os.O_RDWR | os.O_CREAT)
    try:
        alignment, why = _fs.direct_alignment(fd)
    finally:
        os.close(fd)
        os.unlink(tmp_path / ".probe")
    if alignment is None:
        pytest.skip(f"no O_DIRECT in {tmp_path}: {why}")
    return tmp_path


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty directory on a tmpfs (which does no direct I/O): a 16 MiB one mounted for the
    test (the suite runs as root), else a folder in ``/dev/shm``."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(point)], capture_output=True
    )
    if mount.returncode == 0:
        try:
            yield point
        finally:
            subprocess.run(["umount", "-l", str(point)], check=False)
        return
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip(f"cannot mount a tmpfs ({mount.stderr.decode().strip()}) and no /dev/shm")
    folder = shm / f"lightning-bpk-test-{os.getpid()}-{point.parent.name}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
