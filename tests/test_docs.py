"""The documentation site builds strictly: a broken link, a page missing from the nav or an
unresolved reference to a package object (in a page or a docstring) fails this test.

Builds into a temporary directory with the real ``mkdocs`` command (about 5 s), then checks that
the API pages really hold the rendered docstrings and the README links into existing pages.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_process

MKDOCS = Path(sys.executable).with_name("mkdocs")
BUILD_TIMEOUT_S = 120  # a normal build takes ~5 s; this only stops a hung build


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = run_process(
        [MKDOCS, "build", "--strict", "--site-dir", out], cwd=ROOT, env=env, timeout=BUILD_TIMEOUT_S
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


def test_every_nav_page_is_built(site: Path) -> None:
    for page in (
        "quickstart",
        "concepts",
        "format",
        "interop",
        "cli",
        "migrating",
        "benchmarks",
        "reliability",
        "faq",
        "api/checkpointer",
    ):
        assert (site / page / "index.html").is_file(), page


def test_api_pages_render_the_docstrings(site: Path) -> None:
    html = (site / "api" / "checkpointer" / "index.html").read_text()
    # The class and its methods, with text from their docstrings (not just headings).
    assert 'id="lightning_bpk.checkpointer.Checkpointer"' in html
    assert 'id="lightning_bpk.checkpointer.Checkpointer.save_checkpoint"' in html
    assert "garbage-collects everything older" in html
    # reST roles became links, doctests code blocks (not nested block quotes).
    assert "<blockquote>" not in html
    assert ":class:`" not in html and ":func:`" not in html
    callback = (site / "api" / "callback" / "index.html").read_text()
    assert 'href="../checkpointer/#lightning_bpk.checkpointer.Checkpointer"' in callback


def test_error_family_and_layout_are_documented(site: Path) -> None:
    errors = (site / "api" / "errors" / "index.html").read_text()
    assert 'id="lightning_bpk.errors.LightningBpkError"' in errors
    assert "RecordChecksumError" in errors and "CheckpointLockedError" in errors
    records = (site / "api" / "records" / "index.html").read_text()
    assert 'id="lightning_bpk.records.base.RecordChecksumError"' in records
    layout = (site / "api" / "layout" / "index.html").read_text()
    assert 'id="lightning_bpk.layout.DEFAULT_PREFIX"' in layout


def test_api_pages_follow_all(site: Path) -> None:
    """Private knobs and helpers (a leading underscore, not in ``__all__``) stay off the pages."""
    burnpack = (site / "api" / "burnpack" / "index.html").read_text()
    assert 'id="lightning_bpk.burnpack.Pack.data_order"' in burnpack
    assert "_COPY_CHUNK" not in burnpack and "_PARALLEL_HASH_MIN" not in burnpack
    async_save = (site / "api" / "async_save" / "index.html").read_text()
    assert 'id="lightning_bpk.runtime.async_save.AsyncCheckpointSaver"' in async_save
    assert "StagingArea" not in async_save  # runtime._staging: private
    callback = (site / "api" / "callback" / "index.html").read_text()
    assert 'id="lightning_bpk.lightning.callback.log"' not in callback  # a logger, not API


def test_readme_links_point_at_pages(site: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links, "the README links into the docs"
    for link in links:
        assert (ROOT / link).exists(), link


def test_retention_timeline_matches_the_checkpointer(tmp_path: Path) -> None:
    """The worked timeline in concepts.md is what the real Checkpointer leaves on disk."""
    from lightning_bpk import Checkpointer

    page = (ROOT / "docs" / "concepts.md").read_text()
    settings = re.search(r"<!-- retention-timeline f=(\d+) d=(\d+) k=(\d+) -->", page)
    assert settings, "concepts.md has a retention timeline"
    f, d, k = map(int, settings.groups())
    rows = re.findall(r"^\| (\d+) \| (-?\d+) \| [^|]+ \| ([\d, ]+) \|$", page, re.MULTILINE)
    assert len(rows) >= 8
    checkpointer = Checkpointer(
        tmp_path, checkpoint_frequency=f, checkpoint_duration=d, keep_every=k
    )
    for epoch, stale, on_disk in rows:
        for n in range(checkpointer.latest_checkpoint_number() + 1, int(epoch) + 1):
            checkpointer.save_checkpoint(n, {"trainer": {"epoch": n}})
        assert int(stale) == int(epoch) - f * d
        left = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("ckpt.*"))
        assert left == [int(x) for x in on_disk.split(",")], f"after epoch {epoch}"
