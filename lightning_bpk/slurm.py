"""The public path of :mod:`lightning_bpk.lightning.slurm`, which holds the code."""

from lightning_bpk.lightning.slurm import *  # noqa: F403
from lightning_bpk.lightning.slurm import __all__ as __all__
