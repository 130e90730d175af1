"""``python -m lightning_bpk``: the same command line as ``lightning-bpk``."""

import sys

from lightning_bpk.cli import main

if __name__ == "__main__":  # importing it (pytest's doctest collection) must not run the CLI
    sys.exit(main())
