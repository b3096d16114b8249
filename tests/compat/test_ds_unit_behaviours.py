"""Engine behaviours DeepSpeed's own unit tests check, at world 2 (stage 2 unless said):
``backward`` returns the loss over the accumulation steps, ``save_checkpoint(None)`` is a
ValueError, ``zero_to_fp32`` keeps a tied weight's second name, ``no_sync`` cannot be
re-entered, a model built in a nested ``zero.Init`` is partitioned when that Init exits, and
``checkpoint.load_rng_state`` switches the RNG restore off."""

from __future__ import annotations

import pytest

from tests.compat import _ds_unit_workloads as w
from tests.distributed.harness import run_world


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(w.behaviours, 2, timeout_s=300)


def test_backward_returns_loss_over_accumulation_steps(results: list[dict]) -> None:
    for r in results:
        assert r["returned"] == pytest.approx(r["loss"] / 2, rel=1e-6)
        assert r["returned_unscaled"] != pytest.approx(r["returned"])


def test_save_checkpoint_without_directory_is_a_value_error(results: list[dict]) -> None:
    assert all("save_checkpoint(save_dir=None)" in r["save_none"] for r in results)


def test_fp32_state_dict_keeps_tied_weight_keys(results: list[dict]) -> None:
    for r in results:
        assert "layer1.weight" in r["keys"] and "layer2.weight" in r["keys"]
        assert r["tied_kept"] is True  # strict load_state_dict found both names


def test_no_sync_reentry_refused(results: list[dict]) -> None:
    assert all("re-entry is not supported" in r["reentry"] for r in results)


def test_nested_init_partitions_at_inner_exit(results: list[dict]) -> None:
    assert all(r["nested_ds_id"] for r in results)


def test_rng_restore_switch(results: list[dict]) -> None:
    """load_checkpoint restores the RNG by default; checkpoint.load_rng_state=false leaves it
    alone, as DeepSpeed does."""
    assert all(r["rng_restored"] and r["rng_left_alone"] for r in results)
