"""Checkpoints reshard across the tensor-parallel degree (``tensor_parallel.autotp_size``).

One 2-rank world: the reference GPT, a tiny Hugging Face LLaMA and GPT-2 (a fused q|k|v
``c_attn`` split per rank in block order) train 2 steps at tp 2 x ZeRO-1 and save; the
checkpoint is loaded at tp 1 x dp 2 with ZeRO-1 and ZeRO-2, and the tp 1 checkpoint saved by
the first back at tp 2. Each resumed run's next 2 losses and final parameters must equal the
uninterrupted tp 2 run's; the offline exports of the tp 2 checkpoint give the full weights.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.distributed.placement import TPShard
from slipstream.parallel.tensor import tp_join, tp_slice
from tests.checkpoint import _tp_reshard_workloads as w
from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training

KINDS = ["gpt", "llama", "gpt2"]
RESUMED = ["tp2->tp1z1", "tp2->tp1z2", "tp1->tp2z1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(w.world, 2, KINDS, str(tmp_path_factory.mktemp("tp_reshard")))


@pytest.mark.parametrize("kind", KINDS)
def test_resumed_at_another_tp_degree_matches_uninterrupted(world, kind):
    for rank, res in enumerate(world):
        got = res[kind]
        straight = {"losses": got["straight"], "params": got["straight_params"]}
        for label in RESUMED + (["tp2->tp1z3"] if kind == "gpt" else []):
            # The loaded weights are the saved ones, exactly (reassembled, re-cut).
            loaded = got[f"{label} loaded"]
            assert loaded.keys() == got["saved"].keys()
            for name, saved in got["saved"].items():
                torch.testing.assert_close(loaded[name], saved, rtol=0, atol=0, msg=name)
            # GPT-2's key bias gets a gradient of rounding noise only (softmax ignores it),
            # which Adam scales up to lr-sized steps: it differs by layout at ~1e-5.
            atol = 5e-5 if kind == "gpt2" else 2e-6
            assert_same_training(
                got[label], straight, f"{kind} rank {rank} {label}", param_atol=atol
            )
        # The runs trained: the weights moved after the save.
        moved = [not torch.equal(got["saved"][n], p) for n, p in got["straight_params"].items()]
        assert all(moved)


@pytest.mark.parametrize("kind", KINDS)
def test_exports_of_a_tp_checkpoint_hold_full_weights(world, kind):
    got = world[0][kind]
    saved = got["saved"]
    for exported in (got["export"], got["fp32"]):
        assert set(saved) <= set(exported), set(saved) - set(exported)
        assert not any(".tp" in n for n in exported), sorted(exported)
        for name, full in saved.items():
            torch.testing.assert_close(exported[name], full, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", [*KINDS, "bf16"])
def test_weights_masters_and_adam_states_survive_tp2_to_tp1(world, kind):
    """Saved at tp 2, loaded at tp 1 x dp 2 and saved again: every weight, fp32 master (the
    bf16 GPT) and Adam moment is the same full tensor (the tp 1 save holds no slices)."""
    tp2, tp1 = world[0]["states"][kind]
    assert tp2.keys() == tp1.keys()
    assert any(k.startswith("optim/exp_avg_sq/") for k in tp2)
    assert any(k.startswith("master/") for k in tp2) == (kind == "bf16")
    for name, value in tp2.items():
        torch.testing.assert_close(tp1[name], value, rtol=0, atol=0, msg=name)


def test_export_to_deepspeed_of_a_tp_checkpoint_is_tp1(world):
    """``slipstream convert --to deepspeed`` of a tp 2 checkpoint: DeepSpeed files of the full
    weights and Adam moments (read back by slipstream's DeepSpeed reader)."""
    tp2, _ = world[0]["states"]["gpt"]
    ds = world[0]["deepspeed"]
    compared = [k for k in tp2 if k.startswith(("model/", "optim/"))]
    assert any(k.startswith("optim/exp_avg/") for k in compared)
    for name in compared:
        assert name in ds, (name, sorted(ds)[:5])
        torch.testing.assert_close(ds[name].reshape(tp2[name].shape), tp2[name], rtol=0, atol=0)


def test_fused_blocks_rejoin_in_block_order():
    """q|k|v split per rank: joining the ranks' slices gives q|k|v back, not q0 k0 v0 q1..."""
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 18)
    for dim, parts in ((0, 1), (1, 3), (0, 2)):
        x = full if dim == 1 else full.reshape(18, 4)
        for size in (2, 3) if x.shape[dim] % (parts * 3) == 0 else (2,):
            shards = [tp_slice(x, TPShard(dim, parts, r, size)) for r in range(size)]
            torch.testing.assert_close(tp_join(shards, dim, parts), x, rtol=0, atol=0)
    q, k, v = torch.zeros(2, 4), torch.ones(2, 4), torch.full((2, 4), 2.0)
    fused = torch.cat([q, k, v], 0)
    mine = tp_slice(fused, TPShard(0, 3, 1, 2))  # rank 1's halves of q, k and v
    assert mine[:, 0].tolist() == [0.0, 1.0, 2.0]


class _Saved:
    """A checkpoint reader over a dict of full tensors (what ``TPLayoutReader`` wraps)."""

    def __init__(self, tensors, layout):
        from pathlib import Path

        self.tensors, self.dir = tensors, Path("saved")
        self.manifest = {"tp_layout": layout} if layout is not None else {}

    def has(self, t):
        return t in self.tensors

    def names(self, kind):
        return [t.removeprefix(kind + "/") for t in self.tensors if t.startswith(kind + "/")]

    def shape(self, t):
        return tuple(self.tensors[t].shape)

    def dtype(self, t):
        return self.tensors[t].dtype

    def read(self, t, start=0, stop=None, out=None):
        flat = self.tensors[t].reshape(-1)[start:stop]
        return flat.clone() if out is None else out.copy_(flat)

    def read_full(self, t):
        return self.tensors[t].clone()

    def close(self):
        pass


def test_layout_reader_recuts_fused_slices_and_refuses_unrecorded_ones():
    """A fused [q|k|v] weight split over 3 ranks along dim 1 read at 1 rank, at 3 and at 1 of
    a different slice; the Adam state beside it the same; a checkpoint without ``tp_layout``
    is read at its own TP size and refused at another."""
    from slipstream.checkpoint.format import CheckpointError
    from slipstream.checkpoint.tp_layout import TPLayoutReader

    full = torch.randn(4, 18)
    saved = {}
    for r in range(3):
        piece = tp_slice(full, TPShard(1, 3, r, 3))
        saved[f"model/w.tp{r}of3"] = piece
        saved[f"optim/exp_avg/w.tp{r}of3"] = piece * 2
    saved["model/b"] = torch.ones(4)
    whole = TPLayoutReader(_Saved(saved, {"w": [1, 3, 3]}), {"w": None, "b": None})
    assert whole.names("model") == ["w", "b"]
    assert whole.shape("model/w") == (4, 18)
    torch.testing.assert_close(whole.read_full("model/w"), full, rtol=0, atol=0)
    torch.testing.assert_close(whole.read_full("optim/exp_avg/w"), full * 2, rtol=0, atol=0)
    torch.testing.assert_close(whole.read("model/w", 5, 9), full.reshape(-1)[5:9])
    torch.testing.assert_close(whole.read_full("model/b"), torch.ones(4))
    # tp 3 -> tp 1 -> (re-saved full) -> tp 3 rank 2 of a 3-rank layout: its own slice back.
    want = TPShard(1, 3, 2, 3)
    again = TPLayoutReader(_Saved({"model/w": full}, None), {"w": want})
    assert again.names("model") == ["w.tp2of3"]
    torch.testing.assert_close(again.read_full("model/w.tp2of3"), tp_slice(full, want))
    # Saved and wanted cuts that disagree (another plan) are refused, naming both.
    other = TPLayoutReader(_Saved(saved, {"w": [1, 3, 3]}), {"w": TPShard(0, 1, 0, 2)})
    with pytest.raises(CheckpointError, match="split 'w' along dim 1 in 3 block"):
        other.shape("model/w.tp0of2")
    # No tp_layout (an older checkpoint): the same TP size reads as saved, another is refused.
    old = {k: v for k, v in saved.items() if k.startswith("model/w")}
    same = TPLayoutReader(_Saved(old, None), {"w": TPShard(1, 3, 0, 3)})
    assert "w.tp0of3" in same.names("model")
    with pytest.raises(CheckpointError, match=r"load it at tensor_parallel\.autotp_size 3"):
        TPLayoutReader(_Saved(old, None), {"w": None}).names("model")
