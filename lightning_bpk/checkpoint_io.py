"""The public path of :mod:`lightning_bpk.lightning.checkpoint_io`, which holds the code."""

from lightning_bpk.lightning.checkpoint_io import *  # noqa: F403
from lightning_bpk.lightning.checkpoint_io import __all__ as __all__
