"""Pipeline parallelism trains exactly like one process: GPipe, 1F1B and interleaved 1F1B at
PP=2 and PP=4, PP2 x DP2 with ZeRO-1/2/3, TP2 x PP2, TP2 x PP2 x DP2 (ZeRO-1/2/3), tied
embeddings, activation checkpointing; plus activation memory per schedule, partitioned
transfers under TP and a stage without data. Three process spawns in all."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.parallel import _pipe_workloads as w

WORLD2 = {
    "gpipe_m2": dict(pp=2, schedule="gpipe", micro_batches=2),
    "gpipe_m4": dict(pp=2, schedule="gpipe", micro_batches=4),
    "1f1b_m3": dict(pp=2, schedule="1f1b", micro_batches=3),
    "1f1b_m6": dict(pp=2, schedule="1f1b", micro_batches=6),
    "interleaved_m2": dict(pp=2, schedule="interleaved", micro_batches=2, virtual=2),
    "interleaved_m4": dict(pp=2, schedule="interleaved", micro_batches=4, virtual=2),
    "tied_1f1b_m4": dict(pp=2, schedule="1f1b", micro_batches=4, tie=True),
    "ckpt_1f1b_m4": dict(pp=2, schedule="1f1b", micro_batches=4, ckpt=2),
    "tied_clip_1f1b_m4": dict(pp=2, schedule="1f1b", micro_batches=4, tie=True, clip=0.05),
}
WORLD4 = {
    "pp4_gpipe_m4": dict(pp=4, schedule="gpipe", micro_batches=4),
    "pp4_1f1b_m6": dict(pp=4, schedule="1f1b", micro_batches=6),
    "pp4_interleaved_m4": dict(pp=4, schedule="interleaved", micro_batches=4, virtual=2),
    "pp4_interleaved_m8_tied": dict(
        pp=4, schedule="interleaved", micro_batches=8, virtual=2, tie=True
    ),
    "pp2dp2_zero1_m2": dict(pp=2, schedule="1f1b", micro_batches=2, stage=1),
    "pp2dp2_zero2_m4": dict(pp=2, schedule="1f1b", micro_batches=4, stage=2),
    "pp2dp2_zero2_tied_m4": dict(pp=2, schedule="1f1b", micro_batches=4, stage=2, tie=True),
    "pp2dp2_zero2_interleaved_m4": dict(
        pp=2, schedule="interleaved", micro_batches=4, virtual=2, stage=2
    ),
    "pp2dp2_zero1_tied_interleaved": dict(
        pp=2, schedule="interleaved", micro_batches=2, virtual=2, stage=1, tie=True
    ),
    "pp2dp2_zero3_1f1b_m4": dict(pp=2, schedule="1f1b", micro_batches=4, stage=3, clip=0.05),
    "pp2dp2_zero3_tied_interleaved": dict(
        pp=2, schedule="interleaved", micro_batches=2, virtual=2, stage=3, tie=True
    ),
    "tp2pp2_1f1b_m4": dict(pp=2, tp=2, schedule="1f1b", micro_batches=4),
    "tp2pp2_1f1b_m4_unpartitioned": dict(
        pp=2, tp=2, schedule="1f1b", micro_batches=4, partitioned=False
    ),
    "tp2pp2_tied_interleaved_m2": dict(
        pp=2, tp=2, schedule="interleaved", micro_batches=2, virtual=2, tie=True
    ),
}
WORLD8 = {
    "tp2pp2dp2_zero1_1f1b": dict(pp=2, tp=2, schedule="1f1b", micro_batches=2, stage=1),
    "tp2pp2dp2_zero2_tied_gpipe": dict(
        pp=2, tp=2, schedule="gpipe", micro_batches=2, stage=2, tie=True
    ),
    "tp2pp2dp2_zero3_tied_1f1b": dict(
        pp=2, tp=2, schedule="1f1b", micro_batches=2, stage=3, tie=True
    ),
}
MEMORY_M = 8


def _world_body(runs: dict[str, dict[str, Any]], memory: bool) -> dict[str, Any]:
    out: dict[str, Any] = {name: w.pipeline_run(**kw) for name, kw in runs.items()}
    if memory:
        for kind in ("gpipe", "1f1b"):
            out[f"mem_{kind}"] = w.pipeline_run(2, kind, MEMORY_M, steps=1)
        out["starved"] = w.starved_run()
        out["tied_linear"] = w.tied_linear_run()
        for precision in ("bf16", "fp16"):
            out[precision] = w.pipeline_run(2, "1f1b", 4, precision=precision, clip=1.0)
    return out


def body2() -> dict[str, Any]:
    return _world_body(WORLD2, memory=True)


def body4() -> dict[str, Any]:
    return _world_body(WORLD4, memory=False)


def body8() -> dict[str, Any]:
    return {name: w.pipeline_run(**kw) for name, kw in WORLD8.items()}


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_world(body2, 2)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_world(body4, 4)


@pytest.fixture(scope="module")
def world8() -> list[dict[str, Any]]:
    return run_world(body8, 8)


def _check_parity(results: list[dict[str, Any]], name: str, kw: dict[str, Any]) -> None:
    pp, tp = kw["pp"], kw.get("tp", 1)
    dp = len(results) // (pp * tp)
    ref = w.reference_run(kw["micro_batches"], dp, kw.get("tie", False), kw.get("clip", 0.0))
    seen: set[str] = set()
    for rank, res in enumerate(results):
        assert_same_training(res[name], ref, f"{name} rank {rank}")
        seen.update(res[name]["params"])
    missing = set(ref["params"]) - seen - ({"lm_head.weight"} if kw.get("tie") else set())
    assert not missing, f"{name}: parameters held by no stage: {missing}"
    if tp > 1:  # really split: every projection, the embedding and the head (vocab-parallel)
        sharded = set().union(*(set(res[name]["tp_sharded"]) for res in results))
        want = {n for n in ref["params"] if n.endswith("proj.weight")} | {"embed_tokens.weight"}
        if not kw.get("tie"):
            want.add("lm_head.weight")
        assert want <= sharded, f"{name}: not tensor-parallel: {sorted(want - sharded)}"


@pytest.mark.parametrize("name", list(WORLD2))
def test_pp2_matches_single_process(world2: list[dict[str, Any]], name: str) -> None:
    """PP=2: losses (rtol 1e-5) and final parameters equal single-process training."""
    _check_parity(world2, name, WORLD2[name])


@pytest.mark.parametrize("name", list(WORLD4))
def test_pp4_and_pp2_dp2_match_single_process(world4: list[dict[str, Any]], name: str) -> None:
    """PP=4 and PP2 x DP2 (ZeRO-1/2, tied embeddings): same losses and parameters."""
    _check_parity(world4, name, WORLD4[name])


def test_partitioned_transfers_send_half(world4: list[dict[str, Any]]) -> None:
    """pipe_partitioned/grad_partitioned (default on) under TP=2: each rank sends half of
    each activation and gradient between stages (headers aside), same results."""
    for res in world4:
        part = res["tp2pp2_1f1b_m4"]["pp_send_bytes"]
        whole = res["tp2pp2_1f1b_m4_unpartitioned"]["pp_send_bytes"]
        headers = w.STEPS * 4 * 512  # steps x micro-batches x a 64-int64 header
        assert whole > headers and part - headers == pytest.approx((whole - headers) / 2)
        assert res["tp2pp2_1f1b_m4"]["losses"] == res["tp2pp2_1f1b_m4_unpartitioned"]["losses"]


@pytest.mark.parametrize("name", list(WORLD8))
def test_tp2_pp2_dp2_matches_single_process(world8: list[dict[str, Any]], name: str) -> None:
    """TP2 x PP2 x DP2 (8 processes) with ZeRO-1, 2 and 3: same losses and parameters."""
    _check_parity(world8, name, WORLD8[name])


def test_1f1b_holds_at_most_stages_micro_batches(world2: list[dict[str, Any]]) -> None:
    """With m=8 >> p=2, GPipe keeps all 8 micro-batches' activations, 1F1B at most p - s;
    the saved-tensor bytes shrink accordingly."""
    for stage, res in enumerate(world2):
        gpipe, ofob = res["mem_gpipe"], res["mem_1f1b"]
        assert gpipe["peak_in_flight"] == MEMORY_M
        assert ofob["peak_in_flight"] == 2 - stage
        assert ofob["peak_bytes"] * MEMORY_M / (2 - stage) == pytest.approx(
            gpipe["peak_bytes"], rel=0.05
        )


def test_zero3_shards_every_layer(world4: list[dict[str, Any]]) -> None:
    """Under ZeRO-3 every stage's parameters are released between uses (gathered per layer
    just in time), and training still matches (the parity tests above)."""
    for name in ("pp2dp2_zero3_1f1b_m4", "pp2dp2_zero3_tied_interleaved"):
        for res in world4:
            assert res[name]["released"] == res[name]["num_params"] > 0, name


def test_a_stage_without_data_stops_every_stage(world2: list[dict[str, Any]]) -> None:
    """Stage 0's iterator is empty: it names the cause, stage 1 names stage 0; no hang."""
    assert world2[0]["starved"].startswith("PipelineError: the data iterator ran out after 0")
    assert world2[1]["starved"].startswith("PipelineError: pipeline stage 0 could not read")


def test_bf16_and_fp16_pipelines_track_fp32(world2: list[dict[str, Any]]) -> None:
    """bf16 and fp16 (loss-scaled) activations and gradients cross the stages in their
    dtype; the losses stay within 1% of fp32 training and the weights are half precision."""
    ref = w.reference_run(4, 1, clip=1.0)
    for res in world2:
        for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            got = res[precision]
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
            )
            assert all(p.dtype == dtype for p in got["params"].values())


def test_tied_layer_with_several_shared_parameters(world2: list[dict[str, Any]]) -> None:
    """A Linear tied across the two stages by weight *and* bias: each shared parameter's
    gradient is summed over its copies separately (one accumulator per parameter)."""
    ref = w.tied_linear_reference()
    for res in world2:
        torch.testing.assert_close(
            torch.tensor(res["tied_linear"]), torch.tensor(ref), rtol=1e-5, atol=0
        )
