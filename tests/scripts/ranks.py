"""Start a multi-process script's ranks: W processes forked on this machine, rendezvous on a free
127.0.0.1 port. Shared by the standalone scripts (tests/scripts) that run gloo CPU ranks."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch.multiprocessing as mp


def launch(worker: Callable[..., None], world: int, *args: object) -> None:
    """``worker(rank, world, port, *args)`` on ``world`` forked processes; raises if one fails.
    Fork before any torch op in the parent: its thread pool does not survive a fork."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, *args), nprocs=world, start_method="fork")
