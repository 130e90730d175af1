"""Optimizer state as one burnpack, keyed by parameter id (never by position), in Burn's layout.

torch's ``optimizer.state_dict()`` numbers parameters by position, so a reordered
``parameters()`` silently gets the wrong moments. This record keys everything by the u64
``param_id`` of :mod:`lightning_bpk.records.module` and restores by id, so the target optimizer
may list the parameters in any order and in other groups.

Layout (Burn's ``OptimizerRecord``, ``{id}`` = decimal param id):

- state tensors ``{id}.<key>``, each with ``param_id = id``; Burn's names where the meaning is
  Burn's: Adam/AdamW ``exp_avg`` -> ``{id}.momentum.moment_1``, ``exp_avg_sq`` ->
  ``{id}.momentum.moment_2``, ``max_exp_avg_sq`` -> ``{id}.momentum.max_moment_2``, ``step`` ->
  scalar ``{id}.momentum.time`` (``UInt``); SGD ``momentum_buffer`` -> ``{id}.momentum.velocity``;
  every other optimizer keeps torch's keys (``{id}.square_avg``, lists as ``{id}.old_dirs.0``);
- 0-d state tensors (``step``, ASGD's ``eta``/``mu``, NAdam's ``mu_product``) as scalars, with
  their torch dtype kept in the structure so resume is bit-identical;
- scalar ``{id}.__rank`` (``UInt``) for every parameter with state; metadata ``"{id}"`` -> the
  parameter's path;
- ``param_groups.<g>.<hyperparameter>`` (lr, betas as a tuple, flags, ``initial_lr``, None...)
  and ``param_groups.<g>.params.<i>`` (ids), with exact Python types through
  :mod:`lightning_bpk.state`; the optimizer's class in metadata ``lightning_bpk/optimizer``.

LBFGS keeps one flat state over all parameters in their order (under the first parameter), so
it restores only into an LBFGS listing the parameters in the same order; anything else is
refused rather than silently scrambled.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    >>> net(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> record = OptimizerRecord.from_optimizer(opt, net)
    >>> sorted(n.split(".", 1)[1] for n in record.to_content()[0])
    ['momentum.velocity', 'momentum.velocity']
    >>> fresh = torch.optim.SGD(list(net.parameters())[::-1], lr=0.5, momentum=0.0)
    >>> OptimizerRecord.from_bytes(record.to_bytes()).apply(fresh, net).param_groups[0]["lr"]
    0.1
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_bpk import burnpack, state
from lightning_bpk._nested import copy_nested
from lightning_bpk.burnpack import _parallel
from lightning_bpk.records.base import Record, RecordError, _class_name, _Stage
from lightning_bpk.records.module import _param_table

__all__ = [
    "OptimizerRecord",
]

# Metadata entry naming the optimizer class the state belongs to (module.qualname).
_OPTIMIZER_CLASS_KEY = "lightning_bpk/optimizer"
# Group keys not stored: "params" is rebuilt from ids; "param_names" follows the target optimizer.
_GROUP_POSITIONAL_KEYS = ("params", "param_names")

_ADAM_NAMES: dict[str, tuple[str, ...]] = {
    "exp_avg": ("momentum", "moment_1"),
    "exp_avg_sq": ("momentum", "moment_2"),
    "max_exp_avg_sq": ("momentum", "max_moment_2"),
    "step": ("momentum", "time"),
}
# torch state key -> Burn field path, for optimizers whose state Burn names.
BURN_NAMES: dict[type[torch.optim.Optimizer], dict[str, tuple[str, ...]]] = {
    torch.optim.Adam: _ADAM_NAMES,
    torch.optim.AdamW: _ADAM_NAMES,
    torch.optim.SGD: {"momentum_buffer": ("momentum", "velocity")},
}


def _burn_names(recorded_class: str) -> dict[str, tuple[str, ...]]:
    for cls, names in BURN_NAMES.items():
        if f"{cls.__module__}.{cls.__qualname__}" == recorded_class:
            return names
    return {}


def _clone(value: Any) -> Any:
    """A copy of nested data whose tensors own their memory (record tensors may view a file)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values that may hold tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


class OptimizerRecord(Record):
    """Per-parameter optimizer state and param groups, keyed by u64 parameter id.

    ``state`` maps id -> torch's per-parameter state dict; ``param_groups`` is torch's list of
    group dicts with ``params`` holding ids; ``paths`` maps id -> parameter path, ``ranks`` id ->
    parameter rank; ``optimizer_class`` names the optimizer (``torch.optim.adam.Adam``).
    """

    kind = "optimizer"

    def __init__(
        self,
        state: Mapping[int, Mapping[str, Any]],
        param_groups: list[dict[str, Any]],
        *,
        paths: Mapping[int, str],
        ranks: Mapping[int, int],
        optimizer_class: str,
    ) -> None:
        self.state = {pid: dict(s) for pid, s in state.items()}
        self.param_groups = param_groups
        self.paths = dict(paths)
        self.ranks = dict(ranks)
        self.optimizer_class = optimizer_class

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, module: nn.Module) -> OptimizerRecord:
        """Record ``optimizer``'s state, naming its parameters by their id in ``module``.

        Tensors are the optimizer's own (no copy); save or serialize before the next step.
        """
        table = _param_table(module)
        saved = optimizer.state_dict()
        index_to_pid: dict[int, int] = {}
        paths: dict[int, str] = {}
        ranks: dict[int, int] = {}
        owners: dict[int, int] = {}  # pid -> id(param), to catch two parameters with one id
        problems = []
        for g, (saved_group, live_group) in enumerate(
            zip(saved["param_groups"], optimizer.param_groups, strict=True)
        ):
            for i, (index, param) in enumerate(
                zip(saved_group["params"], live_group["params"], strict=True)
            ):
                entry = table.get(id(param))
                if entry is None:
                    problems.append(
                        f"param_groups[{g}] parameter {i} (shape {list(param.shape)}) is not a "
                        "parameter of the module"
                    )
                    continue
                pid, path, _ = entry
                if owners.setdefault(pid, id(param)) != id(param):
                    problems.append(f"parameters '{paths[pid]}' and '{path}' share id {pid}")
                index_to_pid[index] = pid
                paths[pid] = path
                ranks[pid] = param.dim()
        if problems:
            raise RecordError("validation", problems)
        groups = []
        for group in saved["param_groups"]:
            data = {k: v for k, v in group.items() if k not in _GROUP_POSITIONAL_KEYS}
            data["params"] = [index_to_pid[i] for i in group["params"]]
            groups.append(data)
        per_param = {index_to_pid[i]: s for i, s in saved["state"].items() if i in index_to_pid}
        stray = sorted(i for i in saved["state"] if i not in index_to_pid)
        if stray:
            raise RecordError("validation", [f"state {i!r} belongs to no parameter" for i in stray])
        return cls(
            per_param, groups, paths=paths, ranks=ranks, optimizer_class=_class_name(optimizer)
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as torch's positional ``optimizer.state_dict()``, numbering parameters
        group after group in the recorded order (what a same-order optimizer loads).

        Prefer :meth:`apply`, which matches by id; this is for code that needs torch's form.
        """
        index = {pid: i for i, pid in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [dict(g, params=[index[pid] for pid in g["params"]]) for g in self.param_groups]
        return {"state": {index[pid]: s for pid, s in self.state.items()}, "param_groups": groups}

    def apply(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        """Restore the state into ``optimizer`` by parameter id and return it.

        ``module`` names the optimizer's parameters (ids as in :func:`param_ids`; load the
        module record first so they are the recorded ones). Each target group takes the
        hyperparameters of the recorded group its parameters were in. Raises
        :class:`RecordError` listing every problem (another optimizer class, parameters on one
        side only, a group mixing recorded groups with different hyperparameters) before
        changing anything.
        """
        problems = []
        if _class_name(optimizer) != self.optimizer_class:
            problems.append(
                f"record holds {self.optimizer_class} state, the optimizer is "
                f"{_class_name(optimizer)}"
            )
        table = _param_table(module)
        group_of = {pid: g for g, group in enumerate(self.param_groups) for pid in group["params"]}
        target_pids: list[list[int]] = []
        for g, group in enumerate(optimizer.param_groups):
            pids = []
            for i, param in enumerate(group["params"]):
                entry = table.get(id(param))
                if entry is None:
                    problems.append(
                        f"param_groups[{g}] parameter {i} (shape {list(param.shape)}) is not a "
                        "parameter of the module"
                    )
                elif entry[0] not in group_of:
                    problems.append(f"parameter '{entry[1]}' (id {entry[0]}) is not in the record")
                else:
                    pids.append(entry[0])
            target_pids.append(pids)
        seen = {pid for pids in target_pids for pid in pids}
        problems += [
            f"recorded parameter '{self.paths.get(pid, '?')}' (id {pid}) is not in the optimizer"
            for pid in group_of
            if pid not in seen
        ]
        sources = []
        for g, pids in enumerate(target_pids):
            recorded = sorted({group_of[pid] for pid in pids})
            hyper = [
                {k: v for k, v in self.param_groups[r].items() if k != "params"} for r in recorded
            ]
            if any(not _same(hyper[0], h) for h in hyper[1:]):
                problems.append(
                    f"param_groups[{g}] mixes recorded groups {recorded} whose hyperparameters "
                    "differ"
                )
            sources.append(hyper[0] if hyper else None)
        recorded_order = [g["params"] for g in self.param_groups]
        if isinstance(optimizer, torch.optim.LBFGS) and recorded_order != target_pids:
            problems.append(
                "LBFGS keeps one flat state over all parameters in order; the optimizer must "
                "list them in the recorded order"
            )
        if problems:
            raise RecordError("validation", problems)
        torch_state: dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        for g, pids in enumerate(target_pids):
            source = sources[g]
            if source is None:  # a group without parameters keeps its own hyperparameters
                live = optimizer.param_groups[g]
                source = {k: v for k, v in live.items() if k not in _GROUP_POSITIONAL_KEYS}
            group = _clone(source)
            group["params"] = list(range(index, index + len(pids)))
            torch_state["param_groups"].append(group)
            for pid in pids:
                if pid in self.state:
                    torch_state["state"][index] = _clone(self.state[pid])
                index += 1
        optimizer.load_state_dict(torch_state)
        return optimizer

    # -- burnpack content --

    def _tree(self) -> dict[str, Any]:
        return {"state": self.state, "param_groups": self.param_groups}

    def _snapshot(self, stage: _Stage) -> Record | None:
        odd: list[Any] = []
        tree = copy_nested(self._tree(), stage, odd.append)
        if odd:  # e.g. a user object in a param group: encoded now, as it raises
            return None
        snapshot = copy.copy(self)
        snapshot.state, snapshot.param_groups = tree["state"], tree["param_groups"]
        snapshot.paths, snapshot.ranks = dict(self.paths), dict(self.ranks)
        return snapshot

    def to_content(self) -> tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, str]]:
        burn = _burn_names(self.optimizer_class)
        ranks = self.ranks

        def name_path(path: tuple) -> tuple:
            if path[0] != "state":
                return path
            if len(path) > 2 and path[2] in burn:
                return (path[1], *burn[path[2]], *path[3:])
            return path[1:]

        def as_scalar(path: tuple) -> bool:
            # 0-d state of a parameter with rank > 0 is a scalar field (a counter, a factor)
            return (
                path[0] == "state"
                and len(path) == 3
                and (path[2] == "step" or ranks.get(path[1], 0) > 0)
            )

        try:
            content = state.encode(self._tree(), name_path=name_path, as_scalar=as_scalar)
        except state.StateError as e:
            raise RecordError("validation", str(e)) from e
        tensors = {}
        for name, tensor in content.tensors.items():
            head = name.split(".", 1)[0]
            pid = int(head) if head.isdigit() and int(head) in self.state else None
            tensors[name] = burnpack.TensorEntry.from_tensor(tensor, param_id=pid)
        scalars: dict[str, Any] = dict(content.scalars)
        for pid in self.state:
            scalars[f"{pid}.__rank"] = burnpack.Scalar.UInt(self.ranks[pid])
        metadata = {**content.metadata, _OPTIMIZER_CLASS_KEY: self.optimizer_class}
        metadata.update((str(pid), path) for pid, path in self.paths.items())
        return tensors, scalars, metadata

    @classmethod
    @_parallel.gc_paused_call  # one object per tensor: see burnpack._parallel
    def from_pack(cls, pack: burnpack.Pack) -> OptimizerRecord:
        pack.check(pack.data_order)  # every checksum at once, on two threads
        tree = state.decode(pack)
        recorded_class = pack.metadata.get(_OPTIMIZER_CLASS_KEY)
        problems = []
        if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict):
            problems.append("the state tree has no 'state' map")
        elif not all(
            isinstance(pid, int) and isinstance(s, dict) for pid, s in tree["state"].items()
        ):
            problems.append("'state' must map integer parameter ids to state maps")
        elif not isinstance(tree.get("param_groups"), list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in tree["param_groups"]
        ):
            problems.append("'param_groups' is not a list of groups with 'params'")
        if recorded_class is None:
            problems.append(f"no '{_OPTIMIZER_CLASS_KEY}' metadata entry")
        if problems:
            raise RecordError("validation", [f"{pack.source}: {p}" for p in problems])
        paths: dict[int, str] = {}
        ranks: dict[int, int] = {}
        for key, value in pack.metadata.items():
            if key.isdigit():
                paths[int(key)] = value
        for pid, param_state in tree["state"].items():
            rank = pack.scalars.get(f"{pid}.__rank")
            if rank is None:  # Burn's rule: infer it from a state tensor's shape
                dims = [v.dim() for v in param_state.values() if isinstance(v, torch.Tensor)]
                ranks[pid] = max(dims, default=0)
            else:
                ranks[pid] = int(rank.value)
        return cls(
            tree["state"],
            tree["param_groups"],
            paths=paths,
            ranks=ranks,
            optimizer_class=str(recorded_class),  # not None: checked above
        )
