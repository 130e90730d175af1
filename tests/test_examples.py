"""Every example runs as a user runs it (a real subprocess, real training), and every gin file
parses and configures what it says.

``make demo`` (``examples/demo.py``) SIGKILLs a digits run mid-epoch and resumes it;
``examples/preemption_walkthrough.py`` SIGTERMs one and resumes it; both drive
``examples/train_digits.py``. ``examples/burn_mnist_interop.py``'s functions are tested in
``test_interop.py``; here its command line runs too. About a minute in all on 2 cores.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT, import_example, run_process

GIN_FILES = sorted((ROOT / "lightning_bpk" / "gin").glob("*.gin"))
TIMEOUT_S = 240  # each example takes 5-40 s; this only stops a hung one


def run_example(script: str, *args: str, cwd: Path) -> str:
    result = run_process([sys.executable, EXAMPLES / script, *args], cwd=cwd, timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{output[-4000:]}"
    return result.stdout


def test_demo_crashes_and_resumes_at_the_next_epoch(tmp_path: Path) -> None:
    out = run_example("demo.py", cwd=tmp_path)
    assert "exit status -9 (killed by SIGKILL)" in out
    # Checkpoints 0-2 were complete when it died in epoch 3; the second run continues there.
    assert "continuing training at epoch 3" in out and "after checkpoint 2" in out
    assert "saved checkpoint 5" in out
    assert sorted(p.name for p in (tmp_path / "demo-run" / "checkpoints").glob("ckpt.*")) == [
        "ckpt.2",
        "ckpt.3",
        "ckpt.4",
        "ckpt.5",
    ]


def test_preemption_walkthrough_exits_cleanly_and_resumes(tmp_path: Path) -> None:
    out = run_example("preemption_walkthrough.py", "--base_dir", str(tmp_path / "run"), cwd=ROOT)
    assert "sent SIGTERM" in out
    assert "exit status 0 (a clean stop)" in out
    assert re.search(r"preemption signal: saved checkpoint 2 after batch \d+ of epoch 2", out)
    assert "preempted: {'epoch': 2, 'batches':" in out
    assert "continuing training at epoch 2" in out
    assert "saved checkpoint 3" in out
    # The end-of-epoch save of epoch 2 replaced the mid-epoch one: no marker left.
    from lightning_bpk.lightning import trainer_state

    final = trainer_state.load(tmp_path / "run" / "checkpoints" / "ckpt.2")
    assert trainer_state.PREEMPTED_KEY not in final


def test_the_committed_digits_are_the_uci_test_set() -> None:
    """``examples/data/digits.csv.gz`` is the UCI set as scikit-learn ships it: 1797 images of
    8x8 counts 0..16, the class sizes of its description, in its order."""
    images, labels = import_example("digits_data").load_digits()
    assert images.shape == (1797, 8, 8) and images.min() == 0 and images.max() == 16
    assert (images == images.round()).all() and images.sum() == 561718
    counts = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert [int((labels == digit).sum()) for digit in range(10)] == counts
    assert labels[:10].tolist() == list(range(10))


def test_burn_mnist_interop_example_classifies_digits(tmp_path: Path) -> None:
    # the only run of this script (test_interop.py tests its functions in-process)
    out = run_example("burn_mnist_interop.py", cwd=tmp_path)
    assert "on 1797 UCI digits" in out  # every digit was classified
    accuracy = float(re.search(r"accuracy ([\d.]+)%", out).group(1))
    assert accuracy > 80.0, out  # chance is 10%


# Runs in a fresh interpreter: the example registers its gin configurables on import, and gin
# refuses a second registration of the same names in one process.
_GIN_PROBE = textwrap.dedent(
    """
    import json, sys
    import gin
    sys.path.insert(0, sys.argv[1])
    import train_digits  # registers train, DigitsModel, DigitsData
    from lightning_bpk import BurnpackCheckpoint, Checkpointer, get_latest_checkpoint_number

    result = {}
    for path in sys.argv[3:]:
        gin.clear_config()
        gin.parse_config_file(path)
        callback = BurnpackCheckpoint()
        checkpointer = Checkpointer(sys.argv[2])
        result[path] = {
            "frequency": callback.checkpoint_frequency,
            "duration": callback.checkpoint_duration,
            "keep_every": callback.keep_every,
            "resume": callback.resume,
            "checkpointer_duration": checkpointer.checkpoint_duration,
            "latest": get_latest_checkpoint_number("/nonexistent"),
        }
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def gin_settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """What BurnpackCheckpoint, Checkpointer and get_latest_checkpoint_number get from each
    gin file, parsed alone into a clean config."""
    scratch = tmp_path_factory.mktemp("gin")
    result = run_process(
        [sys.executable, "-c", _GIN_PROBE, EXAMPLES, scratch, *GIN_FILES], timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {Path(k).name: v for k, v in json.loads(result.stdout.splitlines()[-1]).items()}


def test_every_gin_file_parses(gin_settings: dict[str, dict]) -> None:
    assert sorted(gin_settings) == [p.name for p in GIN_FILES]
    for name in ("digits.gin", "keep_every_5.gin", "every_2_epochs.gin", "resume_from.gin"):
        assert name in gin_settings, f"the common case {name} has a config"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # The defaults, spelled out: every epoch, newest 4, resume from the newest.
        ("digits.gin", {"frequency": 1, "duration": 4, "keep_every": None, "latest": -1}),
        ("checkpointer.gin", {"checkpointer_duration": 4, "latest": -1}),
        ("keep_every_5.gin", {"keep_every": 5, "frequency": 1}),
        ("every_2_epochs.gin", {"frequency": 2, "keep_every": None}),
        # override_number short-circuits (Dopamine): even a missing directory gives 3.
        ("resume_from.gin", {"latest": 3, "resume": True}),
    ],
)
def test_gin_file_configures_what_it_says(
    gin_settings: dict[str, dict], name: str, expected: dict
) -> None:
    got = gin_settings[name]
    assert {k: got[k] for k in expected} == expected
