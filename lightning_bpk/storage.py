"""The name this package's storage layer had before :mod:`lightning_bpk.store`; re-exports it.

The tuning constants (``ATTEMPTS``, ``READ_CHUNK``, ...) live in
:mod:`lightning_bpk.store.objects`: set them there.
"""

from __future__ import annotations

from lightning_bpk.store import *  # noqa: F403 - the same names, under the old module
from lightning_bpk.store import EXTRAS, LOCAL_PROTOCOLS
from lightning_bpk.store import __all__ as _store_all
from lightning_bpk.store.objects import retry

__all__ = [*_store_all, "EXTRAS", "LOCAL_PROTOCOLS", "retry"]
