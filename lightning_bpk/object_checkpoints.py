"""Former home of the object-store checkpoint protocol, now one implementation for every
backend in :mod:`lightning_bpk.checkpointer`; :func:`load_newest` is re-exported from there."""

from __future__ import annotations

from lightning_bpk.checkpointer import load_newest

__all__ = ["load_newest"]
