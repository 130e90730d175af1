"""The warnings about training data a resume cannot position exactly (in a Lightning fit or a
Fabric loop): what happens instead, when it is exact anyway, and what makes it exact."""

from __future__ import annotations

from typing import Any


def replay_message(loader: Any) -> str:
    dataset = type(getattr(loader, "dataset", loader)).__name__
    return (
        f"the training data (a DataLoader over {dataset}, an iterable dataset without "
        "state_dict/load_state_dict) cannot be positioned without reading it: a resume in the "
        "middle of an epoch reads the batches consumed before the save again and discards them "
        "(the counters continue from the save, no batch is trained twice). That is exact only "
        "if the dataset yields the same batches from the same RNG states, and it costs the time "
        "to load them; give the dataset state_dict/load_state_dict and use torchdata's "
        "StatefulDataLoader for an exact resume that reads nothing twice"
    )


def unpositioned_message(loader: Any) -> str:
    return (
        f"the training data ({type(loader).__name__}) is neither a DataLoader nor has "
        "state_dict/load_state_dict: a resume in the middle of an epoch starts it from its "
        "beginning while the counters continue from the save, so the epoch's first batches are "
        "seen twice and its last ones not at all; wrap it in a DataLoader or give it state"
    )


def workers_message(loader: Any, workers: int, persistent: bool, stateful: bool) -> str:
    later = (
        ", and with persistent_workers=True every later epoch too (the workers keep the new seeds)"
        if persistent
        else ""
    )
    fix = (
        "keep the dataset's randomness in its own generator and return that from the "
        "dataset's state_dict/load_state_dict (StatefulDataLoader saves each worker's dataset "
        "state)"
        if stateful
        else "use torchdata's StatefulDataLoader with a dataset that keeps its randomness in its "
        "own state_dict/load_state_dict, or derive it from the sample index"
    )
    return (
        f"resuming a {type(loader).__name__} with num_workers={workers}: random draws made "
        "inside its worker processes (e.g. torch.rand augmentation in the dataset) are not "
        "restored, so the resumed run's workers start from other seeds and the rest of this "
        f"epoch's batches differ from an uninterrupted run's{later}. The order of the samples "
        f"is exact. For exact batches, {fix}"
    )
