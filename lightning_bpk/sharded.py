"""The public path of :mod:`lightning_bpk.lightning.sharded`, which holds the code."""

from lightning_bpk.lightning.sharded import *  # noqa: F403
from lightning_bpk.lightning.sharded import __all__ as __all__
