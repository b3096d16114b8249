"""Checkpoints: bit-exact resume at every stage, resharding across world sizes and stages,
atomic saves, verified loads, a rank that does not call save is named."""

from __future__ import annotations

import pytest
import torch

from slipstream.checkpoint import CheckpointReader
from tests.checkpoint import _workloads as w
from tests.distributed.harness import run_code, run_world


def _exact(tmp_path, stage, bf16):
    return run_world(w.exact_resume, 2, str(tmp_path), stage, bf16)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, stage):
    """fp32, dropout on, 2 ranks: losses after save/load equal the straight run exactly
    (parameters, Adam states, LR schedule, RNG, data position, step counters)."""
    for r in _exact(tmp_path, stage, bf16=False):
        assert r["resumed"] == r["straight"]
        assert r["client"] == {"note": "hello", "step": 4}
        assert r["steps"] == 4 and r["path"].endswith("global_step4")


def test_bf16_resume_is_bit_identical(tmp_path):
    for r in _exact(tmp_path, 2, bf16=True):
        assert r["resumed"] == r["straight"]


def test_resume_with_nvme_offloaded_optimizer_states_is_bit_identical(tmp_path):
    """Swapped-out Adam states and fp32 masters are checkpointed and restored (stage 3, bf16)."""
    for r in run_world(w.exact_resume, 2, str(tmp_path), 3, True, True):
        assert r["resumed"] == r["straight"]


def _logical(path: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {t: reader.read(t) for t in reader.tensors}


def test_reshard_across_world_sizes_and_stages(tmp_path):
    """Save at 4 ranks / stage 3, load at 2 ranks / stage 1 and at 1 rank / stage 0: every
    parameter, master and optimizer state is identical after the reshard, and training goes on
    like the reference that loaded the same checkpoint at the original world size."""
    src, at2, at1, at4 = (str(tmp_path / n) for n in ("src", "at2", "at1", "at4"))
    run_world(w.save_at, 4, src, 3, 3, "t")
    cont2 = run_world(w.load_and_continue, 2, src, 1, "t", at2, 2)[0]
    cont1 = run_world(w.load_and_continue, 1, at2, 0, "t", at1, 2)[0]
    cont4 = run_world(w.load_and_continue, 4, at1, 3, "t", at4, 2)[0]
    ref = _logical(f"{src}/t")
    for other in (at2, at1, at4):
        got = _logical(f"{other}/t")
        assert set(got) == set(ref)
        for name, tensor in ref.items():
            assert torch.equal(got[name], tensor), (other, name)
    assert len(cont2) == 2
    torch.testing.assert_close(cont2, cont4, rtol=1e-5, atol=0)
    torch.testing.assert_close(cont1, cont4, rtol=1e-5, atol=0)


def test_crash_mid_save_keeps_the_previous_checkpoint_and_corruption_is_named(tmp_path):
    (r,) = run_world(w.failures, 1, str(tmp_path))
    assert "injected" in r["crash"]
    assert "bad" not in r["after_crash"] and "good" in r["after_crash"]
    assert r["latest"] == "good"
    assert r["loaded"].endswith("good") and r["equal_after_crash"]
    assert r["opt_bytes"][0] == r["opt_bytes"][1] > 0
    assert r["kept"] == ["t2", "t3"]
    assert "t3/rank-00000.safetensors is corrupted (CRC-32" in r["corrupt"]
    assert "t2/rank-00000.safetensors has 100 bytes" in r["truncated"]
    assert r["no_latest"] == (None, None)


def test_a_rank_that_does_not_call_save_is_named(tmp_path):
    results = run_world(w.missing_rank, 2, str(tmp_path))
    assert results[1] == "skipped"
    msg = results[0]
    # Rank 1's process ends after it skipped the call: the survivor says so at once.
    assert "save_checkpoint: rank 1 is gone: its connection closed" in msg, msg


_UNCOMMITTED = """
import slipstream
from slipstream.models import GPT, GPTConfig
config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "checkpoint": {"async_save": True}}
engine = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)[0]
engine.save_checkpoint(SAVE_DIR, tag="t")  # then the script ends: no destroy, no wait
"""


def test_async_save_never_committed_is_reported_at_exit(tmp_path):
    """A script that ends with an async save in flight: at exit the writer thread finishes
    its file (finalization does not stop it mid-write) and a warning says the checkpoint was
    not committed (it used to vanish silently)."""
    done = run_code(_UNCOMMITTED.replace("SAVE_DIR", repr(str(tmp_path))), timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "save_checkpoint(" in done.stderr and "was never committed" in done.stderr, done.stderr[
        -2000:
    ]
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()


def test_async_save_snapshots_the_state_and_commits_later(tmp_path):
    """checkpoint.async_save: training goes on while the shards are written; the checkpoint
    holds the state at save time (bit-exact resume) once committed by the next load."""
    for r in run_world(w.exact_resume, 2, str(tmp_path), 3, False, False, True):
        assert r["resumed"] == r["straight"]
