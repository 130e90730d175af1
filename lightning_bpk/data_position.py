"""The public path of :mod:`lightning_bpk.lightning.data_position`, which holds the code."""

from lightning_bpk.lightning.data_position import *  # noqa: F403
from lightning_bpk.lightning.data_position import __all__ as __all__
