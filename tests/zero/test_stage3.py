"""ZeRO-3 on 2 gloo ranks: tied weights, a module called twice, frozen layers and an HF model
match single-process training; parameters are 1/N per rank; divergence is an error."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.zero import _stage3_workloads as w

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results():
    return run_world(w.all_checks, 2)


@pytest.mark.parametrize("kind", ["twice", "llama"])
def test_stage3_matches_single_process(results, kind):
    """Final parameters equal single-process AdamW on the same global batches (fp32)."""
    ref = w.reference(kind, world=2)
    for r in results:
        got = r[kind]["params"]
        assert set(got) == set(ref)
        for name, p in ref.items():
            torch.testing.assert_close(
                got[name], p, rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_stage3_parameters_are_partitioned(results):
    """Each rank holds 1/N of the trainable parameters (within 5%, padding included)."""
    for r in results:
        for kind in ("twice", "llama"):
            shard, total = r[kind]["shard_numel"], r[kind]["total_numel"]
            assert abs(shard - total / 2) <= 0.05 * total / 2, (kind, shard, total)


def test_rank_divergence_is_an_error_naming_modules_and_ranks(results):
    for r in results:
        msg = r["diverge"]
        assert "ranks diverged" in msg
        assert (
            "module 'layers.1' on dp ranks [0]" in msg
            and "module 'layers.2' on dp ranks [1]" in msg
        )
