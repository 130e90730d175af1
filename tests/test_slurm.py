"""SLURM auto-requeue against a real one-node SLURM cluster (slurm-wlm and munge from Debian).

The module fixture starts ``munged``, ``slurmctld`` and ``slurmd`` as root with a
``slurm.conf`` in a temporary folder (``JobRequeue=1``, one partition of this node) and stops
them afterwards. Jobs run ``exec srun python tests/scripts/slurm_job.py`` as the docs advise;
the tests deliver the requeue signal and check that the job is requeued exactly once, that the
second run resumes from the preemption checkpoint and ends bit-identical to an uninterrupted
run (the session's ``tiny_reference``: slurm_job.py trains lightning_tiny's model exactly as
lightning_tiny.py does), and that no process is left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gin
import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_bpk.checkpointer import get_latest_checkpoint_number
from lightning_bpk.lightning.callback import BurnpackCheckpoint
from lightning_bpk.records import ModuleRecord
from lightning_bpk.runtime import slurm

from conftest import SCRIPTS, TINY_REFERENCE_EPOCHS
from lightning_tiny import TinyModel, make_trainer

SCRIPT = SCRIPTS / "slurm_job.py"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")
EPOCHS = TINY_REFERENCE_EPOCHS  # the length of the shared uninterrupted reference run
PAUSE_EPOCH = 1
WAIT = 120.0  # seconds for any one job transition; a lost signal fails instead of hanging

pytestmark = pytest.mark.timeout(6 * WAIT)


def test_job_id_names_an_array_task_as_lightning_does():
    assert slurm.job_id({"SLURM_JOB_ID": "17"}) == "17"
    array = {"SLURM_JOB_ID": "21", "SLURM_ARRAY_JOB_ID": "20", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm.job_id(array) == "20_3"
    with pytest.raises(ValueError, match="unexpected SLURM job id '1; rm'"):
        slurm.job_id({"SLURM_JOB_ID": "1; rm"})
    assert slurm.restart_count({}) == 0
    assert slurm.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2


def test_the_requeue_switch_is_gin_configurable():
    assert BurnpackCheckpoint().auto_requeue is True
    with gin.unlock_config():
        gin.parse_config("lightning_bpk.BurnpackCheckpoint.auto_requeue = False")
    try:
        assert BurnpackCheckpoint().auto_requeue is False
    finally:
        gin.clear_config()


# -- a one-node cluster ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A running one-node cluster: ``run`` calls its client commands, ``job`` reads a job."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        root, node = self.root, socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = root / "munge" / "munge.socket"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=lbpk",
                    f"SlurmctldHost={node}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={munge}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "JobRequeue=1",
                    "ReturnToService=2",
                    "KillWait=30",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                    f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                    f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        munge_files = [
            f"--{name}-file={root / 'munge' / ('munged.' + name)}"
            for name in ("log", "pid", "seed")
        ]
        self._daemon(
            ["munged", "-F", "--force", f"--socket={munge}", f"--key-file={key}", *munge_files]
        )
        self._wait(lambda: munge.exists(), "munged to create its socket")
        self._daemon(["slurmctld", "-D", "-f", str(self.conf)])
        self._daemon(["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(
            lambda: "IDLE" in self.run("scontrol", "show", "node", node, check=False),
            "the node to become idle",
        )

    def _daemon(self, command: list[str]) -> None:
        with open(self.root / "log" / f"{command[0]}.out", "w") as log:
            self.daemons.append(
                subprocess.Popen(
                    command, stdout=log, stderr=log, start_new_session=True, env=self.env
                )
            )

    def _wait(self, ready, what: str, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for daemon in self.daemons:
                assert daemon.poll() is None, f"{daemon.args[0]} died:\n{self.logs()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.root / "log").iterdir())
        )

    def run(self, *command: str, check: bool = True) -> str:
        result = subprocess.run(
            command, capture_output=True, text=True, env=self.env, timeout=60, check=False
        )
        if check:
            assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
        return result.stdout + result.stderr

    def submit(self, script: str) -> str:
        path = self.root / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        return self.run("sbatch", "--parsable", str(path)).strip()

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, job_id: str, what: str, condition) -> dict[str, str]:
        found: dict[str, str] = {}

        def ready() -> bool:
            found.update(self.job(job_id))
            return condition(found)

        self._wait(ready, f"job {job_id} {what}")
        return found

    def stop(self) -> None:
        if self.daemons and self.daemons[-1].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False)
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"needs slurm-wlm and munge (apt-get install slurm-wlm munge): no {missing}")
    if os.geteuid() != 0:
        pytest.skip("a one-node SLURM cluster runs its daemons as root here; not root")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


# -- jobs --------------------------------------------------------------------------------------


def job_script(root: Path, *args: str, sbatch: tuple[str, ...] = (), tasks: int = 1) -> str:
    """The job script the docs recommend: append to the output, requeueable, ``exec srun``."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --output={root / 'job.out'}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --ntasks-per-node={tasks}",
        *(f"#SBATCH {option}" for option in sbatch),
        f"exec srun {sys.executable} {SCRIPT} --root {root} --epochs {EPOCHS} {' '.join(args)}",
    ]
    return "\n".join(lines) + "\n"


def assert_no_process_left(root: Path) -> None:
    mine = str(root).encode()
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mine in (proc / "cmdline").read_bytes():
                left.append(proc.name)
        except OSError:  # gone meanwhile
            pass
    assert not left, f"processes left behind: {left}"


def wait_for_file(path: Path, cluster: Cluster) -> None:
    cluster._wait(path.exists, f"{path.name} to appear")


def params(path: Path) -> dict[str, torch.Tensor]:
    return ModuleRecord.load(path).tensors


def test_usr1_to_the_batch_shell_saves_requeues_once_and_the_rerun_ends_bit_identical(
    tmp_path, cluster, tiny_reference
):
    root = tmp_path / "run"
    root.mkdir()
    out = str(tmp_path / "final.bpk")
    job = cluster.submit(job_script(root, "--pause-epoch", str(PAUSE_EPOCH), "--out", out))
    wait_for_file(root / "paused", cluster)  # the first run is training, paused in epoch 1
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # to the batch shell (srun) only

    cluster.wait_for(job, "requeued", lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING")
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")  # no 2-minute BeginTime
    final = cluster.wait_for(job, "completed", lambda j: j["JobState"] in ("COMPLETED", "FAILED"))
    assert final["JobState"] == "COMPLETED", (root / "job.out").read_text()
    assert final["Restarts"] == "1"  # requeued exactly once

    log = (root / "job.out").read_text()
    first, second = log.split("START rank=0 restart=1")
    checkpoint = root / "checkpoints" / f"ckpt.{PAUSE_EPOCH}"
    assert f"requeued SLURM job {job} (`scontrol requeue {job}`)" in first, log
    assert f"it resumes from {checkpoint}" in first
    assert f"saved checkpoint {PAUSE_EPOCH} at the end of epoch {PAUSE_EPOCH}; stopping" in first
    assert "EXIT rank=0 restart=0" in first  # an orderly exit, before SLURM's kill
    assert "FINISHED" not in first and "Traceback" not in log and "srun: error" not in log
    assert f"SLURM job {job} was requeued (restart 1): this run continues from {checkpoint}" in (
        second
    ), log
    assert f"FINISHED rank=0 epoch={EPOCHS} step={EPOCHS * 6} restored={PAUSE_EPOCH}" in second
    assert "requeued SLURM job" not in second  # the finished run did not requeue again

    # the same training without SLURM and without interruption
    want, got = params(tiny_reference / "ref.bpk"), params(Path(out))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert_no_process_left(tmp_path)


def _minutes(duration: str) -> int:
    """SLURM's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``), in whole minutes."""
    days, _, clock = duration.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return int(days or 0) * 1440 + seconds // 60


def test_time_limit_warning_to_the_steps_of_a_ddp_job_requeues_once_and_both_ranks_resume(
    tmp_path, cluster
):
    # 2 tasks under srun (Lightning's SLURM DDP: one process per task), and the warning signal
    # that SLURM itself sends to the job steps ahead of the time limit (--signal=USR1@150).
    root = tmp_path / "run"
    root.mkdir()
    port = _free_port()
    script = job_script(
        root,
        "--devices 2 --pause-epoch",
        str(PAUSE_EPOCH),
        sbatch=("--time=10", "--signal=USR1@150"),
        tasks=2,
    ).replace("exec srun", f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={port}\nexec srun")
    job = cluster.submit(script)
    wait_for_file(root / "paused", cluster)
    # Both ranks are training: bring the time limit near, so the warning is due within 30 s; the
    # controller sends it at its next periodic time-limit check (every 30 s). RunTime is read in
    # whole minutes, so 121-180 s are left at the update and at least 90 s when the warning
    # comes: time for the save and the requeue on a loaded machine.
    elapsed = _minutes(cluster.job(job)["RunTime"])
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={elapsed + 3}")

    cluster.wait_for(job, "requeued", lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING")
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10")
    final = cluster.wait_for(job, "completed", lambda j: j["JobState"] in ("COMPLETED", "FAILED"))
    log = (root / "job.out").read_text()
    assert final["JobState"] == "COMPLETED", log
    assert final["Restarts"] == "1", log
    first, second = log.split("START rank=0 restart=1")
    assert log.count("`scontrol requeue") == 1  # rank 0 only, once
    assert f"requeued SLURM job {job} (`scontrol requeue {job}`)" in first, log
    assert "EXIT rank=0 restart=0" in first and "EXIT rank=1 restart=0" in first, log
    assert "Traceback" not in log and "srun: error" not in log
    checkpoint = root / "checkpoints" / f"ckpt.{PAUSE_EPOCH}"
    assert f"this run continues from {checkpoint}" in second
    batches = 3  # 48 samples over 2 ranks, batch size 8
    for rank in (0, 1):
        assert f"FINISHED rank={rank} epoch={EPOCHS} step={EPOCHS * batches} restored=1" in second
    assert_no_process_left(tmp_path)


# -- in-process: the decision, against the real controller ---------------------------------------


class _SignalAt(L.Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def slurm_env(cluster, monkeypatch):
    """This process looks like task 0 of a one-task srun step of a job the controller does not
    know (so a requeue attempt fails for real, with scontrol's own message)."""
    variables = dict(
        SLURM_CONF=str(cluster.conf),
        SLURM_JOB_ID="987654",
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
    )
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return variables


def _fit_until_signal(root: Path, signum: int, callback: BurnpackCheckpoint, **kwargs) -> None:
    L.seed_everything(0)
    trainer = make_trainer(str(root), 2, [callback, _SignalAt(8, signum)], **kwargs)
    assert isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)
    with pytest.raises(SystemExit) as stop:
        trainer.fit(TinyModel())
    assert stop.value.code is None  # exit status 0


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("unknown job", "(`scontrol requeue 987654` failed with exit status 1: "),
        ("requeue_signal=SIGUSR2", "(`scontrol requeue 987654` failed with exit status 1: "),
        ("no job id", "(no usable job id in the environment: KeyError('SLURM_JOB_ID')"),
    ],
)
def test_a_failed_requeue_is_logged_with_scontrols_output_and_loses_nothing(
    tmp_path, slurm_env, caplog, monkeypatch, case, refusal
):
    caplog.set_level(logging.INFO, logger="lightning_bpk")
    signum, kwargs = signal.SIGUSR1, {}
    if case == "requeue_signal=SIGUSR2":  # Lightning's option, handled like SIGUSR1
        signum = signal.SIGUSR2
        kwargs["plugins"] = [SLURMEnvironment(requeue_signal=signum)]
    if case == "no job id":
        monkeypatch.delenv("SLURM_JOB_ID")
    _fit_until_signal(tmp_path, signum, BurnpackCheckpoint(), **kwargs)
    checkpoint = tmp_path / "checkpoints" / "ckpt.1"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert refusal in errors[0]
    if case != "no job id":
        assert "Invalid job id specified" in errors[0]  # scontrol's own words
    assert f"the checkpoint {checkpoint} is saved: submit the job again" in errors[0]
    assert "stopping (exit status 0)" in caplog.text
    assert get_latest_checkpoint_number(tmp_path / "checkpoints", verify=True) == 1

    callback = BurnpackCheckpoint()
    make_trainer(str(tmp_path), 2, [callback]).fit(TinyModel())
    assert callback.restored_number == 1


@pytest.mark.parametrize("case", ["callback switch off", "Lightning's switch off", "SIGTERM"])
def test_no_requeue_when_switched_off_or_when_the_scheduler_ends_the_job(
    tmp_path, slurm_env, caplog, case
):
    caplog.set_level(logging.INFO, logger="lightning_bpk")
    callback = BurnpackCheckpoint(auto_requeue=case != "callback switch off")
    kwargs = {}
    if case == "Lightning's switch off":
        kwargs["plugins"] = [SLURMEnvironment(auto_requeue=False)]
    signum = signal.SIGTERM if case == "SIGTERM" else signal.SIGUSR1
    _fit_until_signal(tmp_path, signum, callback, **kwargs)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name == "lightning_bpk")
    assert "stopping (exit status 0)" in ours
    assert "SLURM job" not in ours  # no requeue attempted (it would have failed, and said so)
    assert get_latest_checkpoint_number(tmp_path / "checkpoints", verify=True) == 1
