"""The public path of :mod:`lightning_bpk.lightning.callback`, which holds the code."""

from lightning_bpk.lightning.callback import *  # noqa: F403
from lightning_bpk.lightning.callback import __all__ as __all__
from lightning_bpk.lightning.callback import log  # noqa: F401
