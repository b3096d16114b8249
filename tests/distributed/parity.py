"""The parity check of the parallel tests: a run's losses and final parameters against a
single-process reference on the same seed and global batch."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def assert_same_training(
    got: Mapping[str, object],
    ref: Mapping[str, object],
    label: str,
    *,
    loss_rtol: float = 1e-5,
    param_rtol: float = 1e-4,
    param_atol: float = 2e-6,
) -> None:
    """``got["losses"]`` equal ``ref["losses"]`` (relative ``loss_rtol``) and every
    parameter of ``got["params"]`` (name -> tensor, a subset of the reference's) is close to
    the reference's; failures name ``label`` and the parameter."""
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(ref["losses"]),
        rtol=loss_rtol,
        atol=0,
        msg=lambda m: f"{label}: losses differ: {m}",
    )
    ref_params = ref["params"]
    assert isinstance(ref_params, Mapping)
    got_params = got["params"]
    assert isinstance(got_params, Mapping)
    for name, p in got_params.items():
        assert name in ref_params, f"{label}: {name!r} is not a reference parameter"
        torch.testing.assert_close(
            p,
            ref_params[name],
            rtol=param_rtol,
            atol=param_atol,
            msg=lambda m, name=name: f"{label} {name}: {m}",
        )
