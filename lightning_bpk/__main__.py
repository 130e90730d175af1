"""``python -m lightning_bpk``: the same command line as ``lightning-bpk``."""

import sys

from lightning_bpk.cli import main

sys.exit(main())
