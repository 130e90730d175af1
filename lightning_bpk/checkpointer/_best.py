"""The best-k retention rule: keep the ``k`` best checkpoints by a monitored metric.

It sits beside Dopamine's rule (:class:`lightning_bpk.checkpointer._commit.Retention`): after a
save, a checkpoint stays while it is among the ``k`` best **or** Dopamine's rule keeps it. Each
checkpoint's metric is recorded in its sentinel's manifest
(:class:`~lightning_bpk.checkpointer.manifest.Metric`), so the ranking is read from the
directory itself: exact after a resume, on object stores, and from ``lightning-bpk ls``.

The ranking is Lightning ``ModelCheckpoint``'s on the same sequence of values:

- NaN ranks as the worst possible value (``ModelCheckpoint`` replaces it by ``+inf`` for
  ``"min"``, ``-inf`` for ``"max"``): it is among the k best only while fewer than k others are;
  ``+inf``/``-inf`` rank as the numbers they are.
- A checkpoint saved without the metric (``value`` None) is never among the best (as
  ``ModelCheckpoint`` does not save it as a top-k one); Dopamine's rule alone decides it.
  So is a checkpoint whose manifest records another metric name, or none.
- Ties: the older checkpoint (smaller number) ranks first, so an equal value never displaces
  one already kept (``ModelCheckpoint`` replaces its k-th only by a strictly better value).
- ``k = -1`` keeps every checkpoint with the metric, ``k = 0`` none (Dopamine's rule still
  keeps its own).

>>> rule = BestK("val_loss", "min", 2)
>>> rule.ranked({1: 0.5, 2: float("nan"), 3: 0.2, 4: None, 5: 0.5})
[3, 1, 5, 2]
>>> sorted(rule.kept({1: 0.5, 2: float("nan"), 3: 0.2, 4: None, 5: 0.5}))
[1, 3]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_bpk.checkpointer.manifest import Metric, quote

MODES = ("min", "max")


@dataclass(frozen=True)
class BestK:
    """Keep the ``k`` best checkpoints by the metric ``monitor``; ``mode`` ``"min"`` or
    ``"max"`` says which way is better (module docstring)."""

    monitor: str
    mode: str = "min"
    k: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(f"monitor must be a metric name, got {quote(self.monitor)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {quote(self.mode)}")
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"save_top_k must be an int >= -1, got {quote(k)}")

    def metric(self, value: float | None) -> Metric:
        """What the manifest of a checkpoint saved with ``value`` records (None: not logged)."""
        return Metric(self.monitor, None if value is None else float(value), self.mode)

    def value_of(self, metric: Metric | None) -> float | None:
        """The value a recorded ``metric`` ranks with (None: not a candidate: no metric, not
        logged, or another metric's name)."""
        if metric is None or metric.name != self.monitor:
            return None
        return metric.value

    def _key(self, number: int, value: float) -> tuple[float, int]:
        worst = math.inf if self.mode == "min" else -math.inf
        v = worst if math.isnan(value) else value
        return (v if self.mode == "min" else -v, number)

    def ranked(self, values: Mapping[int, float | None]) -> list[int]:
        """The numbers with a value, best first (ties: the older first)."""
        scored = [(n, v) for n, v in values.items() if v is not None]
        return [n for n, v in sorted(scored, key=lambda nv: self._key(*nv))]

    def kept(self, values: Mapping[int, float | None]) -> set[int]:
        """The numbers among the ``k`` best of ``values``."""
        ranked = self.ranked(values)
        return set(ranked if self.k < 0 else ranked[: self.k])
