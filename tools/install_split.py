"""Install two requirement files resolved as one: the first into this venv, the second beside it.

Usage: ``.venv/bin/python tools/install_split.py VENV_REQS BESIDE_REQS FOLDER CONSTRAINTS``

pip resolves both files together against the venv (a dry run with a report), so every version
agrees with every other. The venv then gets ``VENV_REQS`` at those versions; ``FOLDER`` gets
what ``BESIDE_REQS`` needs beyond the venv, without dependencies (the venv's copies of
anything else would shadow the folder's, so a distribution the venv already has at another
version stops the install, naming both). ``make test`` keeps there the libraries the tests
import only in the pytest process (``requirements-slow-imports.txt``; the Makefile says why).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]


def resolve(*args: str) -> list[tuple[str, str]]:
    """``(name, version)`` of each distribution ``pip install *args`` would install here."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([*PIP, "install", "--dry-run", "--report", str(report), *args], check=True)
        installs = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in installs]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(venv_reqs: str, beside_reqs: str, folder: str, constraints: str) -> None:
    both = resolve("-c", constraints, "-r", venv_reqs, "-r", beside_reqs)
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "pins.txt"
        pins.write_text("".join(f"{name}=={version}\n" for name, version in both))
        pinned = ["-c", constraints, "-c", str(pins)]
        subprocess.run([*PIP, "install", *pinned, "-r", venv_reqs], check=True)
        importlib.invalidate_caches()
        beside = resolve(*pinned, "-r", beside_reqs)
    clashes = [
        f"{name} {version} (the venv has {installed(name)})"
        for name, version in beside
        if installed(name) is not None
    ]
    if clashes:
        sys.exit(f"{beside_reqs} would replace what {sys.prefix} has: {', '.join(clashes)}")
    wanted = [f"{name}=={version}" for name, version in beside]
    if wanted:
        subprocess.run([*PIP, "install", "--no-deps", "--target", folder, *wanted], check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
