"""Expert parallelism with tensor parallelism (tp 2 x ep 2, experts replicated over TP or split
by expert TP; ZeRO-0/1 and ZeRO-3, and bf16 ZeRO-2 within bf16 rounding; DroplessMoE and an
AutoEP block with the TP token split) and 4-rank expert splitting (ep 2, edp 2, ZeRO-2) on 4
gloo ranks equal one process on the same global batch: losses, clipped global gradient norms,
parameters after 3 steps; the tp 2 x ep 2 checkpoint loads into a tp 2 x ep 1 engine; ep 2
over sp 2 x dp 2 (the reference GPT, Ulysses) equals one process too; what is refused is
refused by name (pipelines with ep_size 2: test_pipeline_ep.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slipstream.parallel.tensor import tp_slice
from tests.distributed.harness import run_world
from tests.moe import _tp_workloads as w

TOL = {"rtol": 1e-5, "atol": 1e-6}
# bf16 parameters with fp32 master weights over 3 steps: bf16 rounding (2**-8 relative) of
# values near 1, a few roundings deep.
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = str(tmp_path_factory.mktemp("expert_tp"))
    out: list[dict[str, Any]] = run_world(w.world, 4, tmp, timeout_s=500)
    return out


def _check(res: dict[str, Any], ref: dict[str, Any], tol: dict[str, float] = TOL) -> None:
    rel = tol["rtol"]
    for step in range(w.STEPS):
        assert res["losses"][step] == pytest.approx(ref["losses"][step][res["dp_rank"]], rel=rel)
        assert res["norms"][step] == pytest.approx(ref["norms"][step], rel=rel)
    assert ref["norms"][0] > w.CLIP  # clipping took effect
    for name, (p, shard) in res["params"].items():
        torch.testing.assert_close(p, w.expected(ref["params"], name, shard), **tol)


@pytest.mark.parametrize("expert_tp", [False, True])
def test_tp2_ep2_equals_one_process(ranks: list[dict[str, Any]], expert_tp: bool) -> None:
    """tp 2 x ep 2: experts whole on both TP ranks (ZeRO-1; each computes half of the rows)
    or split by expert TP (ZeRO-0); every rank's parameters equal the one-process ones."""
    for res in ranks:
        run = res[f"tp2_ep2_{expert_tp}"]
        assert run["expert_split"] is expert_tp
        # Replicated experts: each TP rank computes its half of the rows (TPTokenSplit).
        assert run["exchange"] == ("exchange_and_run" if expert_tp else "TPTokenSplit")
        assert run["edp"] == [1]  # ep 2 over dp 2: one rank per expert group
        _check(run, res["ref_tp"])


@pytest.mark.parametrize("expert_tp", [False, True])
def test_tp2_ep2_zero3_equals_one_process(ranks: list[dict[str, Any]], expert_tp: bool) -> None:
    """tp 2 x ep 2 at ZeRO-3 (fp32), both expert layouts: dense parameters partitioned over
    dp, experts over their expert-data-parallel group; equal to one process."""
    for res in ranks:
        run = res[f"tp2_ep2_z3_{expert_tp}"]
        assert run["expert_split"] is expert_tp
        assert run["exchange"] == ("exchange_and_run" if expert_tp else "TPTokenSplit")
        _check(run, res["ref_tp"])


def test_expert_tp_all_to_all_carries_one_tp_share(ranks: list[dict[str, Any]]) -> None:
    """Expert TP at tp 2 x ep 2: each TP rank sends half of the rows it sent whole before
    (forward and backward all-to-alls), the two TP ranks' shares add up to the whole rows,
    and the loss and every local gradient equal those of the whole-row exchange."""
    for rank, res in enumerate(ranks):
        run = res["a2a_rows"]
        shared, whole = run["shared"], run["whole"]
        peer = ranks[rank ^ 1]["a2a_rows"]["shared"]  # the other TP rank (tp innermost)
        assert len(shared["rows"]) == len(whole["rows"]) == 4  # 2 forward, 2 backward
        assert sum(whole["rows"]) > 0
        for mine, theirs, full in zip(shared["rows"], peer["rows"], whole["rows"], strict=True):
            assert mine + theirs == full
            assert abs(2 * mine - full) <= w.EXPERTS  # each expert's block split near evenly
        assert shared["loss"] == pytest.approx(whole["loss"], rel=1e-6)
        assert shared["grads"].keys() == whole["grads"].keys()
        for name, g in shared["grads"].items():
            torch.testing.assert_close(g, whole["grads"][name], **TOL)


def test_tp2_ep2_bf16_zero2_within_bf16_rounding(ranks: list[dict[str, Any]]) -> None:
    """tp 2 x ep 2, experts replicated over TP, ZeRO-2 in bf16 (fp32 master weights): losses,
    norms and parameters within bf16 rounding of the fp32 one-process run."""
    for res in ranks:
        run = res["tp2_ep2_bf16"]
        assert run["exchange"] == "TPTokenSplit"
        _check(run, res["ref_tp"], BF16_TOL)


@pytest.mark.parametrize("kind", ["dropless", "autoep"])
def test_stacked_experts_tp2_ep2_equals_one_process(ranks: list[dict[str, Any]], kind: str) -> None:
    """DroplessMoE, and an AutoEP block, with ep_size 2 under tp 2 (ZeRO-1): whole stacked
    experts on both TP ranks, each computing its half of every expert's rows (TPTokenSplit),
    expert gradients summed over TP; losses, norms and every rank's parameters equal one
    process."""
    for res in ranks:
        run, ref = res[f"{kind}_tp2_ep2"], res[f"ref_{kind}"]
        assert run["expert_split"] is False
        assert run["exchange"] == "TPTokenSplit"
        assert run["edp"] == [1]
        for step in range(w.STEPS):
            assert run["losses"][step] == pytest.approx(
                ref["losses"][step][run["dp_rank"]], rel=1e-5
            )
            assert run["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-5)
        assert ref["norms"][0] > w.CLIP
        assert run["params"].keys() == ref["params"].keys()
        for name, (p, shard) in run["params"].items():
            want = w.local_experts(ref["params"], name, run["ep_rank"], 2)
            torch.testing.assert_close(p, want if shard is None else tp_slice(want, shard), **TOL)


@pytest.mark.parametrize("expert_tp", [False, True])
def test_tp2_ep2_checkpoint_loads_at_ep1(ranks: list[dict[str, Any]], expert_tp: bool) -> None:
    """Every expert was saved once under its global id: a tp 2 x ep 1 engine reads them all."""
    for res in ranks:
        loaded = res[f"reload_{expert_tp}"]
        assert len([n for n in loaded if w.PREFIX in n]) == 4 * w.EXPERTS
        for name, (p, shard) in loaded.items():
            torch.testing.assert_close(p, w.expected(res["ref_tp"]["params"], name, shard), **TOL)


@pytest.mark.parametrize("expert_tp", [False, True])
def test_tp2_ep2_checkpoint_loads_at_tp1_ep1(ranks: list[dict[str, Any]], expert_tp: bool) -> None:
    """The same checkpoint at tp 1 x ep 1 (dp 4): whole experts, equal to the tp 2 reload."""
    for res in ranks:
        whole = {n: p for n, (p, shard) in res[f"reload_tp1_{expert_tp}"].items()}
        assert all(shard is None for _, shard in res[f"reload_tp1_{expert_tp}"].values())
        for name, (p, shard) in res[f"reload_{expert_tp}"].items():
            torch.testing.assert_close(p, w.expected(whole, name, shard), rtol=0, atol=0)


def test_four_rank_expert_splitting_zero2(ranks: list[dict[str, Any]]) -> None:
    """4 experts, ep 2, edp 2 (two ranks per expert group) at ZeRO-2 equal one process."""
    for res in ranks:
        run = res["ep2_edp2"]
        assert run["edp"] == [2]
        _check(run, res["ref_edp"])


@pytest.mark.parametrize("run_name", ["ep2_sp2_z0", "ep2_sp2"])
def test_sp2_dp2_ep2_equals_one_process(ranks: list[dict[str, Any]], run_name: str) -> None:
    """ep 2 cut from the flattened dp x sp ranks (sp innermost, DeepSpeed's layout): the two
    sequence shards of a row exchange tokens, expert gradients are reduced over the other
    row's ranks; losses, global norms, every step's gradients and the parameters after 3
    ZeRO-0 and ZeRO-2 steps equal one process on the whole batch (every expert gets tokens)."""
    for rank, res in enumerate(ranks):
        run, ref = res[run_name], res["ref_sp"]
        assert run["ep_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert run["ep_rank"] == rank % 2 and run["edp"] == [2]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert ref["norms"][0] > w.CLIP
        for step in range(w.STEPS):
            for e in range(w.EXPERTS):
                assert ref["grads"][step][f"{w.SP_PREFIX}{e}.down_proj.weight"].abs().sum() > 0
            assert len(run["grads"][step]) == len(ref["grads"][step]) - w.EXPERTS // 2 * 3
            for name, g in run["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][name], **TOL)
        for name, p in run["params"].items():
            torch.testing.assert_close(p, ref["params"][name], **TOL)


def test_sp2_dp2_ep2_checkpoint_loads_at_ep1(ranks: list[dict[str, Any]]) -> None:
    """Every expert of the ep 2 x sp 2 run was saved once under its global id: an ep 1 engine
    (sp 2 x dp 2) reads all four, equal to the one-process parameters."""
    for res in ranks:
        loaded = res["reload_sp"]
        assert len([n for n in loaded if w.SP_PREFIX in n]) == 3 * w.EXPERTS
        assert loaded.keys() == res["ref_sp"]["params"].keys()
        for name, p in loaded.items():
            torch.testing.assert_close(p, res["ref_sp"]["params"][name], **TOL)


def test_tp_pieces_split_every_expert_evenly() -> None:
    """Rank r takes rows [c*r//tp, c*(r+1)//tp) of each expert's block, in row order."""
    from slipstream.moe.tensor_parallel import tp_pieces

    pieces = tp_pieces(torch.tensor([5, 0, 1, 4]), 2)
    assert pieces[0].tolist() == [0, 1, 6, 7]
    assert pieces[1].tolist() == [2, 3, 4, 5, 8, 9]


def test_tp_piece_counts_are_the_pieces_rows_per_expert() -> None:
    """The closed form the exchanges use equals counting the rows of each piece by expert."""
    from slipstream.moe.tp_rows import tp_piece_counts, tp_pieces

    g = torch.Generator().manual_seed(0)
    for tp in (1, 2, 3, 4):
        counts = torch.randint(0, 9, (6,), generator=g)
        expert = torch.repeat_interleave(torch.arange(6), counts)
        for r, piece in enumerate(tp_pieces(counts, tp)):
            want = torch.bincount(expert[piece], minlength=6)
            assert torch.equal(tp_piece_counts(counts, tp, r), want), (tp, r, counts)


def test_refusals_name_the_fix(ranks: list[dict[str, Any]]) -> None:
    """An ep_size not dividing the dp x sp ranks, expert TP with experts the TP plan left whole,
    and a dropless layer of ep_size 2 whose experts a TP plan split are refused, naming the
    setting to change."""
    for res in ranks:
        msg = res["refusals"]
        assert "ep_size=3 must divide the data-parallel size 4 (data x sequence" in msg["sp"]
        assert "enable_expert_tensor_parallelism=True but no expert parameter" in msg["unsplit"]
        assert (
            "DroplessMoE expert parameters ['w1'] are split over the tensor-parallel"
            in (msg["dropless"])
        )
        assert "with ep_size=2 this layer keeps whole experts" in msg["dropless"]
