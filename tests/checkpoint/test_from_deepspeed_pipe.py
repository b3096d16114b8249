"""A pipeline-parallel checkpoint DeepSpeed 0.19.8 wrote (``PipelineModule``, 2 stages on 2
ranks, ZeRO-1 and without ZeRO) loads into slipstream's pipeline engine (2 stages) and into an
``nn.Sequential`` of the same layers at world 1: the next losses are DeepSpeed's own (fp32,
within 1e-5); what is not read is refused naming the file."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.checkpoint import CheckpointError, CheckpointReader, deepspeed_to_slipstream
from slipstream.checkpoint.deepspeed_pipe import DeepSpeedPipeReader, open_deepspeed
from tests.checkpoint import _deepspeed_pipe_workloads as w
from tests.distributed.harness import run_world

FIXTURE = Path(__file__).parent / "deepspeed_pipe_fixture"
"""2 stages, world 2, ZeRO-1, fp32, written by DeepSpeed 0.19.8 (``make_deepspeed_fixture``)."""
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
FP32 = {"rel": 1e-5, "abs": 1e-6}
# (DeepSpeed's ZeRO stage, slipstream's) at world 2 (pipeline) and world 1 (nn.Sequential).
TWO = [(1, 1), (0, 0)]
ONE = [(1, 2), (0, 0)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The committed ZeRO-1 checkpoint; where DeepSpeed is installed, a stage-0 one it writes
    now. slipstream resumes each in one world of 2 ranks and one of 1."""
    root = tmp_path_factory.mktemp("from_ds_pipe")
    shutil.copytree(FIXTURE, root / "ds_pipe_s1")
    want = {1: json.loads((FIXTURE / "expected.json").read_text())["losses"]}
    if HAS_DEEPSPEED:
        want.update(run_world(w.deepspeed_runs, 2, str(root), [0], timeout_s=400)[0])
    two = run_world(w.slipstream_resumes, 2, str(root), [c for c in TWO if c[0] in want])
    one = run_world(w.slipstream_resumes, 1, str(root), [c for c in ONE if c[0] in want])
    return {"want": want, "two": two, "one": one[0]}


@pytest.mark.parametrize(
    ("world", "case"),
    [(2, c) for c in TWO] + [(1, c) for c in ONE],
    ids=lambda v: str(v) if isinstance(v, int) else f"ds_stage{v[0]}-stage{v[1]}",
)
def test_pipeline_resumes_with_deepspeeds_losses(
    runs: dict[str, Any], world: int, case: tuple[int, int]
) -> None:
    """World 2: slipstream's 2-stage pipeline; world 1: an nn.Sequential of the layers."""
    if case[0] not in runs["want"]:
        pytest.skip("needs deepspeed (writes the stage-0 checkpoint)")
    for got in runs["two"] if world == 2 else [runs["one"]]:
        run = got[case]
        assert run["losses"] == pytest.approx(runs["want"][case[0]], **FP32)
        assert (run["steps"], run["epoch"]) == (w.SAVED + w.MORE, 7)


def _copy(tmp_path: Path) -> Path:
    tag = tmp_path / "global_step2"
    shutil.copytree(FIXTURE / "global_step2", tag)
    return tag


def test_layers_go_to_their_stages(tmp_path: Path) -> None:
    """Without a world: the layer files' weights under ``<layer>.<key>``, each stage's
    partitions matched to them (fp32: every master equals the layer file's weight)."""
    tag = _copy(tmp_path)
    reader = open_deepspeed(tag)
    assert isinstance(reader, DeepSpeedPipeReader)
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias", "4.weight", "4.bias"]
    assert sorted(reader.names("model")) == sorted(names)
    for name in names:
        idx, key = name.split(".")
        layer = torch.load(tag / f"layer_{int(idx):02d}-model_states.pt")
        assert torch.equal(reader.read_full(f"master/{name}"), layer[key]), name
    assert reader.manifest["global_steps"] == w.SAVED
    # `slipstream convert --to slipstream`: the same tensors in a slipstream checkpoint.
    converted = CheckpointReader(deepspeed_to_slipstream(tag, tmp_path / "conv"))
    assert sorted(converted.tensors) == sorted(reader.tensors)
    for t in reader.tensors:
        assert torch.equal(converted.read_full(t), reader.read_full(t)), t


def test_pipeline_files_refused_or_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks mp_rank_01_model_states\.pt"):
        open_deepspeed(tag)
    tag = _copy(tmp_path / "b")
    shutil.copy(tag / "layer_00-model_states.pt", tag / "layer_00-model_01-model_states.pt")
    with pytest.raises(CheckpointError) as err:
        open_deepspeed(tag)
    assert str(err.value).startswith(f"{tag / 'layer_00-model_01-model_states.pt'}: a tensor-")
    tag = _copy(tmp_path / "c")
    (tag / "layer_04-model_states.pt").unlink()  # stage 1 then lacks 4.weight and 4.bias
    with pytest.raises(CheckpointError, match="the layer files do not belong"):
        open_deepspeed(tag)
