"""The public path of :mod:`lightning_bpk.lightning.trainer_state`, which holds the code."""

from lightning_bpk.lightning.trainer_state import *  # noqa: F403
from lightning_bpk.lightning.trainer_state import __all__ as __all__
