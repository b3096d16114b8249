"""RepeatingLoader over the engine's resumable loader: epochs go on across a resume."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from slipstream.data.loader import build_dataloader
from slipstream.utils import RepeatingLoader


def _loader() -> object:
    data = TensorDataset(torch.arange(8))
    return build_dataloader(data, micro_batch=2, dp_world_size=1, dp_rank=0, seed=3)


def test_repeating_loader_continues_after_the_resumed_epoch() -> None:
    """A loader put back in epoch 5 (mid-pass) finishes that pass, then draws epoch 6's
    order: not epoch 1's, and never StopIteration (the example that resumed 7 times died)."""
    ref = _loader()
    ref.set_epoch(5)  # type: ignore[attr-defined]
    first = list(ref)  # type: ignore[call-overload]
    ref.set_epoch(6)  # type: ignore[attr-defined]
    sixth = [b[0].tolist() for b in ref]  # type: ignore[attr-defined]

    resumed = _loader()
    resumed.load_state_dict({"epoch": 5, "batches": 2, "micro_batch": 2, "replicas": 1})  # type: ignore[attr-defined]
    batches = RepeatingLoader(resumed)
    got = [next(batches)[0].tolist() for _ in range(2 + 4)]
    assert got[:2] == [b[0].tolist() for b in first[2:]]  # the rest of epoch 5
    assert got[2:] == sixth
    assert batches.epoch == 6
