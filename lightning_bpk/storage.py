"""The former name of :mod:`lightning_bpk.store`, which holds the code; re-exports it."""

from lightning_bpk.store import *  # noqa: F403
from lightning_bpk.store import __all__ as __all__
