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


def test_global_rng_draws_match_torchs_dataloader() -> None:
    """As DeepSpeed's loader (a torch DataLoader without a generator): one draw from the
    global RNG when an epoch's first batch is fetched, none after; a loader resumed mid-epoch
    draws none (the epoch's draw is in the restored RNG state)."""
    data = TensorDataset(torch.arange(8))
    torch.manual_seed(0)
    start = torch.get_rng_state()
    plain = iter(torch.utils.data.DataLoader(data, batch_size=2))
    next(plain)
    want = torch.get_rng_state()
    assert not torch.equal(want, start)

    torch.manual_seed(0)
    loader = iter(_loader())  # type: ignore[call-overload]
    assert torch.equal(torch.get_rng_state(), start)  # nothing drawn before the first fetch
    next(loader)
    assert torch.equal(torch.get_rng_state(), want)
    next(loader)
    assert torch.equal(torch.get_rng_state(), want)

    resumed = _loader()
    resumed.load_state_dict({"epoch": 0, "batches": 1, "micro_batch": 2, "replicas": 1})  # type: ignore[attr-defined]
    torch.manual_seed(0)
    next(iter(resumed))  # type: ignore[call-overload]
    assert torch.equal(torch.get_rng_state(), start)
