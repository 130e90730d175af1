"""The public path of :mod:`lightning_bpk.lightning.async_save`, which holds the code."""

from lightning_bpk.lightning.async_save import *  # noqa: F403
from lightning_bpk.lightning.async_save import __all__ as __all__
