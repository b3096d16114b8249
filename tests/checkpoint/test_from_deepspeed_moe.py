"""A mixture-of-experts checkpoint DeepSpeed 0.19.8 wrote (``deepspeed.moe.layer.MoE``, ZeRO-2,
2 ranks, ep_size 1 and 2) loads into slipstream's MoE at the same or another ep_size and world
size: every expert in place, and the next losses are DeepSpeed's own (fp32, within 1e-5)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.checkpoint import CheckpointError, CheckpointReader, deepspeed_to_slipstream
from slipstream.checkpoint.from_deepspeed import DeepSpeedReader
from tests.checkpoint import _deepspeed_moe_workloads as w
from tests.distributed.harness import run_world

FIXTURE = Path(__file__).parent / "deepspeed_moe_fixture"
"""ep_size 2, world 2, ZeRO-2, fp32, written by DeepSpeed 0.19.8 (``make_deepspeed_fixture``)."""
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
FP32 = {"rel": 1e-5, "abs": 1e-6}
# (DeepSpeed's ep_size and ZeRO stage, slipstream's ep_size and ZeRO stage) at world 2 and 1.
TWO = [(2, 2, 2, 2), (2, 2, 1, 1), (1, 2, 2, 2), (2, 0, 2, 0)]
ONE = [(2, 2, 1, 2), (1, 2, 1, 0), (2, 0, 1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The committed ep_size-2 ZeRO-2 checkpoint; where DeepSpeed is installed, an ep_size-1
    ZeRO-2 one and an ep_size-2 one without ZeRO that it writes now. slipstream resumes each
    in one world of 2 ranks and one of 1."""
    root = tmp_path_factory.mktemp("from_ds_moe")
    shutil.copytree(FIXTURE, w.saved_dir(str(root), 2, 2))
    want = {(2, 2): json.loads((FIXTURE / "expected.json").read_text())["losses"]}
    if HAS_DEEPSPEED:
        cases = [(1, 2), (2, 0)]
        want.update(run_world(w.deepspeed_runs, w.DS_WORLD, str(root), cases, timeout_s=400)[0])
    two = [c for c in TWO if c[:2] in want]
    one = [c for c in ONE if c[:2] in want]
    got = run_world(w.slipstream_resumes, 2, str(root), two)
    got1 = run_world(w.slipstream_resumes, 1, str(root), one)[0]
    return {"root": root, "want": want, "two": got, "one": got1}


def _check(run: dict[str, Any], want: list[float]) -> None:
    assert run["losses"] == pytest.approx(want, **FP32)
    assert run["counters"] == (w.SAVED, w.SAVED * w.MICRO * w.DS_WORLD)
    assert run["epoch"] == 7


def _expert_files(tag: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(tag.glob("layer_*_expert_*_model_states.pt")):
        out.update(torch.load(f, map_location="cpu"))
    return out


@pytest.mark.parametrize(
    "case", TWO + ONE, ids=lambda c: f"ds_ep{c[0]}_stage{c[1]}-ep{c[2]}_stage{c[3]}"
)
def test_moe_resumes_with_deepspeeds_losses(runs: dict[str, Any], case: Any) -> None:
    """Same ep_size, another ep_size at world 2, and ep_size 1 at world 1 (ZeRO 0-2), from
    DeepSpeed's ZeRO-2 and its run without ZeRO: every expert holds the weights of DeepSpeed's
    expert file and the losses go on as DeepSpeed's."""
    if case[:2] not in runs["want"]:
        pytest.skip("needs deepspeed (writes the ep_size-1 and the stage-0 checkpoints)")
    ranks = runs["two"] if case in TWO else [runs["one"]]
    tag = w.saved_dir(str(runs["root"]), case[0], case[1]) / f"global_step{w.SAVED}"
    saved = _expert_files(tag)
    held: dict[str, torch.Tensor] = {}
    for rank in ranks:
        _check(rank[case], runs["want"][case[:2]])
        held.update(rank[case]["experts"])
    assert held.keys() == saved.keys()  # every expert, over the ranks, by its global id
    for name, value in saved.items():
        assert torch.equal(held[name], value), name


def _copy(tmp_path: Path) -> Path:
    tag = tmp_path / "global_step2"
    shutil.copytree(FIXTURE / "global_step2", tag)
    return tag


def test_moe_layout_reads_every_expert(tmp_path: Path) -> None:
    """Without a world: the reader names every expert globally, its fp32 master equal to the
    expert file (fp32 training), with Adam states for each."""
    reader = DeepSpeedReader(_copy(tmp_path))
    saved = _expert_files(tmp_path / "global_step2")
    assert len(saved) == 16  # 4 experts x 4 tensors
    for name, value in saved.items():
        assert torch.equal(reader.read_full(f"master/{name}"), value), name
        assert reader.has(f"optim/exp_avg/{name}") and reader.has(f"optim/exp_avg_sq/{name}")
    assert reader.manifest["global_steps"] == w.SAVED
    # `slipstream convert --to slipstream`: the same tensors in a slipstream checkpoint.
    converted = CheckpointReader(
        deepspeed_to_slipstream(tmp_path / "global_step2", tmp_path / "conv")
    )
    assert sorted(converted.tensors) == sorted(reader.tensors)
    for t in reader.tensors:
        assert torch.equal(converted.read_full(t), reader.read_full(t)), t


@pytest.mark.parametrize(
    ("name", "what"),
    [
        (
            "expert_0_mp_rank_00_model_states.pt",
            "a mixture-of-experts file of DeepSpeed before 0.6",
        ),
    ],
)
def test_unread_moe_files_are_refused_by_file(tmp_path: Path, name: str, what: str) -> None:
    tag = _copy(tmp_path)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / name)
    with pytest.raises(CheckpointError) as err:
        DeepSpeedReader(tag)
    assert str(err.value).startswith(f"{tag / name}: {what}")
    assert "slipstream cannot read it" in str(err.value)


def test_missing_expert_file_is_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    (tag / "layer_0_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=re.escape("lacks the expert files of layer 0")):
        DeepSpeedReader(tag)
