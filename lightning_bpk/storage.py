"""The name this package's storage layer had before :mod:`lightning_bpk.store`; re-exports it.

The tuning constants (``ATTEMPTS``, ``READ_CHUNK``, ...) live in
:mod:`lightning_bpk.store.objects`: set them there.
"""

from __future__ import annotations

from lightning_bpk.store import (
    EXTRAS,
    LOCAL_PROTOCOLS,
    DirectoryGoneError,
    LocalStore,
    MissingDriverError,
    ObjectStore,
    StorageError,
    Store,
    is_local,
    join,
    local_path,
    location,
    name_of,
    object_store,
    open_parent,
    open_store,
    parent_of,
    protocol_of,
)
from lightning_bpk.store.objects import retry

__all__ = [
    "EXTRAS",
    "LOCAL_PROTOCOLS",
    "DirectoryGoneError",
    "LocalStore",
    "MissingDriverError",
    "ObjectStore",
    "StorageError",
    "Store",
    "is_local",
    "join",
    "local_path",
    "location",
    "name_of",
    "object_store",
    "open_parent",
    "open_store",
    "parent_of",
    "protocol_of",
    "retry",
]
