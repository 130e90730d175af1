"""Install requirements into a folder beside this venv: only what the venv lacks, no upgrades.

Usage: ``.venv/bin/python tools/install_beside.py FOLDER REQUIREMENTS CONSTRAINTS``

pip resolves the requirements against the venv (a dry run with a report), so the folder gets
exactly the distributions the venv does not have, at versions that agree with what it has;
one that would replace a distribution of the venv stops the install, naming both versions
(the venv's copy would shadow the folder's). Then they are installed there without their
dependencies. ``make test`` puts the libraries the tests import only in the pytest process
there (``requirements-slow-imports.txt``; the Makefile says why).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]


def missing(requirements: str, constraints: str) -> list[tuple[str, str]]:
    """``(name, version)`` of each distribution pip would install into this venv."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = ["install", "--dry-run", "--report", str(report), "-c", constraints]
        subprocess.run([*PIP, *command, "-r", requirements], check=True)
        installs = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in installs]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(folder: str, requirements: str, constraints: str) -> None:
    wanted = missing(requirements, constraints)
    clashes = [
        f"{name} {version} (the venv has {installed(name)})"
        for name, version in wanted
        if installed(name) is not None
    ]
    if clashes:
        sys.exit(f"{requirements} would replace what {sys.prefix} has: {', '.join(clashes)}")
    pins = [f"{name}=={version}" for name, version in wanted]
    subprocess.run([*PIP, "install", "--no-deps", "--target", folder, *pins], check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
