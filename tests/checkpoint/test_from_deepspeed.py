"""A checkpoint DeepSpeed 0.19.8 wrote resumes on slipstream with DeepSpeed's own continuation
losses (fp32 within 1e-5), at the same or another world size and ZeRO stage, with its step
counters, lr scheduler and client state; what cannot be read is refused naming the file."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.checkpoint import CheckpointError, CheckpointReader, export_deepspeed
from slipstream.checkpoint.from_deepspeed import DeepSpeedReader
from slipstream.cli.main import main as cli
from tests.checkpoint import _deepspeed_workloads as w
from tests.distributed.harness import run_world

FIXTURE = Path(__file__).parent / "deepspeed_fixture"
"""ZeRO-2, world 2, fp32, written by DeepSpeed 0.19.8 (``make_deepspeed_fixture`` rewrites it)."""
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"
)
FP32 = {"rel": 1e-5, "abs": 1e-6}


def _check_resumed(run: dict[str, Any], want: list[float], tol: dict[str, float]) -> None:
    assert run["losses"] == pytest.approx(want, **tol)
    assert run["counters"] == (w.SAVED, w.SAVED * w.MICRO * w.DS_WORLD, 0)
    assert run["lr_scheduler"] == {"last_batch_iteration": w.SAVED - 1}
    assert run["epoch"] == 7
    assert run["after"] == (w.SAVED + w.MORE) * w.MICRO * w.DS_WORLD


# ---------------------------------------------------- the committed DeepSpeed-written fixture
@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("from_ds")
    shutil.copytree(FIXTURE, root / "ds_s2")
    return root


@pytest.fixture(scope="module")
def fixture_runs(fixture_root: Path) -> tuple[dict[Any, Any], dict[Any, Any]]:
    # `slipstream convert --to slipstream`: the same checkpoint in slipstream's format.
    assert cli(["convert", str(fixture_root / "ds_s2"), str(fixture_root / "conv"), "--to",
                "slipstream"]) == 0  # fmt: skip
    two = run_world(
        w.slipstream_resumes, 2, str(fixture_root), [(2, False, 2), (2, False, 3, False)]
    )
    one = run_world(w.slipstream_resumes, 1, str(fixture_root), [(2, False, 1), ("conv", False, 2)])
    return two[0], one[0]


def test_fixture_resumes_with_deepspeeds_losses(fixture_runs: Any) -> None:
    """Same world and stage, and resharded to ZeRO-1 at world 1: DeepSpeed's recorded losses."""
    want = json.loads((FIXTURE / "expected.json").read_text())["losses"]
    two, one = fixture_runs
    _check_resumed(two[(2, False, 2)], want, FP32)
    _check_resumed(one[(2, False, 1)], want, FP32)
    assert two[(2, False, 2)]["path"].endswith("ds_s2/global_step3")


def test_converted_fixture_resumes_with_deepspeeds_losses(fixture_runs: Any) -> None:
    """``slipstream convert --to slipstream`` writes a slipstream checkpoint that resumes
    the same way (here at world 1, stage 2)."""
    want = json.loads((FIXTURE / "expected.json").read_text())["losses"]
    run = fixture_runs[1][("conv", False, 2)]
    _check_resumed(run, want, FP32)
    assert run["path"].endswith("conv/global_step3")


def test_optimizer_states_matter(fixture_runs: Any) -> None:
    """Control: without the Adam states the second step already leaves DeepSpeed's path."""
    want = json.loads((FIXTURE / "expected.json").read_text())["losses"]
    cold = fixture_runs[0][(2, False, 3, False)]["losses"]
    assert cold[0] == pytest.approx(want[0], **FP32)  # the weights were loaded
    assert cold[1] != pytest.approx(want[1], rel=1e-4)


def test_another_optimizer_is_refused(fixture_root: Path) -> None:
    msg = run_world(w.slipstream_loads_with_sgd, 1, str(fixture_root))[0]
    assert msg.startswith("CheckpointError: ")
    assert "['exp_avg', 'exp_avg_sq'] of DeepSpeed's optimizer (AdamW)" in msg
    assert "this engine's optimizer is SGD, which keeps ['momentum_buffer']" in msg
    assert "load_optimizer_states=False" in msg


def _copy(tmp_path: Path) -> Path:
    tag = tmp_path / "global_step3"
    shutil.copytree(FIXTURE / "global_step3", tag)
    return tag


def test_missing_rank_file_is_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"partitioned over \[2\] ranks but .* holds 1"):
        DeepSpeedReader(tag)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(
        tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    with pytest.raises(CheckpointError, match=r"lacks the optimizer files of ranks \[0, 1\]"):
        DeepSpeedReader(tag)


def test_damaged_file_and_missing_key_are_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    path = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(
        CheckpointError, match=re.escape(f"cannot read DeepSpeed checkpoint file {path}")
    ):
        DeepSpeedReader(tag)
    torch.save({"optimizer_state_dict": {"zero_stage": 2}}, path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} has no key 'single_partition_")):
        DeepSpeedReader(tag)


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("mp_rank_01_model_states.pt", "a model-parallel (tensor-parallel) rank file"),
        ("zero", "a universal checkpoint folder without optimizer_state.pt"),
    ],
)
def test_unreadable_kinds_are_refused_by_file(tmp_path: Path, name: str, what: str) -> None:
    tag = _copy(tmp_path)
    if name == "zero":
        (tag / name).mkdir()
    else:
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / name)
    with pytest.raises(CheckpointError) as err:
        DeepSpeedReader(tag)
    assert str(err.value).startswith(f"{tag / name}: {what}")
    assert "slipstream cannot read it" in str(err.value)


# ---------------------------------------------------- DeepSpeed itself, where installed
_DS_CASES = [(2, False), (3, False), (2, True), (0, False), (0, True)]


@pytest.fixture(scope="module")
def deepspeed_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Any, Any]]:
    root = tmp_path_factory.mktemp("ds_written")
    losses = run_world(w.deepspeed_runs, w.DS_WORLD, str(root), _DS_CASES, True, timeout_s=400)
    return root, losses[0]


@pytest.fixture(scope="module")
def resumed(deepspeed_root: Any) -> tuple[dict[Any, Any], dict[Any, Any]]:
    root = str(deepspeed_root[0])
    two = [
        (2, False, 2),
        (3, False, 3),
        (2, False, 1),
        (3, False, 2),
        (2, True, 2),
        (0, False, 2),
        (0, True, 1),
    ]
    one = [(2, False, 3), (3, False, 0), ("ds_uni", False, 2)]
    return run_world(w.slipstream_resumes, 2, root, two)[0], run_world(
        w.slipstream_resumes, 1, root, one
    )[0]


@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_resumes_deepspeed_at_same_world_and_stage(
    deepspeed_root: Any, resumed: Any, stage: int
) -> None:
    # DeepSpeed's stage 0 (its torch optimizer's state dict) resumes at slipstream's stage 2.
    got = resumed[0][(stage, False, stage or 2)]
    _check_resumed(got, deepspeed_root[1][(stage, False)], FP32)


@needs_deepspeed
@pytest.mark.parametrize(
    ("ds_stage", "world", "stage"), [(2, 2, 1), (3, 2, 2), (2, 1, 3), (3, 1, 0)]
)
def test_resumes_deepspeed_resharded(
    deepspeed_root: Any, resumed: Any, ds_stage: int, world: int, stage: int
) -> None:
    """DeepSpeed at world 2 -> slipstream at another stage, at world 2 or 1."""
    run = resumed[world == 1][(ds_stage, False, stage)]
    _check_resumed(run, deepspeed_root[1][(ds_stage, False)], FP32)


@needs_deepspeed
def test_resumes_deepspeed_universal_checkpoint(deepspeed_root: Any, resumed: Any) -> None:
    """DeepSpeed's ds_to_universal of its ZeRO-2 checkpoint (found through
    ``latest_universal``) resumes at world 1, stage 2, with DeepSpeed's losses."""
    run = resumed[1][("ds_uni", False, 2)]
    _check_resumed(run, deepspeed_root[1][(2, False)], FP32)
    assert run["path"].endswith("ds_uni/global_step3")


@needs_deepspeed
def test_resumes_deepspeed_bf16(deepspeed_root: Any, resumed: Any) -> None:
    """bf16 weights with fp32 masters: the first step is the same forward (equal), the next
    ones within bf16's rounding of the reduced gradients (5e-4 relative)."""
    for ds_stage, stage in ((2, 2), (0, 1)):  # ZeRO-2, and DeepSpeed's BF16_Optimizer
        want = deepspeed_root[1][(ds_stage, True)]
        got = resumed[0][(ds_stage, True, stage)]
        assert got["losses"][0] == want[0]
        _check_resumed(got, want, {"rel": 5e-4, "abs": 0.0})


@needs_deepspeed
def test_export_resumes_in_deepspeed(tmp_path: Path) -> None:
    """slipstream ZeRO-3 at world 2 saves; ``convert --to deepspeed`` lays it out for
    DeepSpeed ZeRO-2 and ZeRO-3 (with a sub_group_size that cuts the model into two
    sub-groups) at world 2; DeepSpeed loads each and continues with slipstream's own
    continuation losses, and DeepSpeed's zero_to_fp32 reads slipstream's masters back."""
    want = run_world(w.slipstream_saves, 2, str(tmp_path), 3)[0]
    for stage in (2, 3):
        assert cli(["convert", str(tmp_path / "ss"), str(tmp_path / f"to_ds{stage}"), "--to",
                    "deepspeed", "--world-size", "2", "--zero-stage", str(stage),
                    "--sub-group-size", "50"]) == 0  # fmt: skip
    cases = [("to_ds2", 2, None), ("to_ds3", 3, 50)]
    got = run_world(w.deepspeed_resumes, 2, str(tmp_path), cases, timeout_s=400)[0]
    from tests.compat._deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    reader = CheckpointReader(next((tmp_path / "ss").glob("global_step*")))
    for sub in ("to_ds2", "to_ds3"):
        assert got[sub]["losses"] == pytest.approx(want, **FP32), sub
        assert got[sub]["counters"] == (w.SAVED, w.SAVED * w.MICRO * w.DS_WORLD, 0)
        assert got[sub]["epoch"] == 7
        weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / sub))
        assert sorted(weights) == sorted(reader.names("model"))
        for name, value in weights.items():  # fp32: no separate masters
            assert torch.equal(value, reader.read_full(f"model/{name}")), (sub, name)


def test_export_refuses_what_it_cannot_write(tmp_path: Path, fixture_root: Path) -> None:
    with pytest.raises(CheckpointError, match="zero_stage=0 is not supported"):
        export_deepspeed(tmp_path, tmp_path / "out", zero_stage=0)
    # A converted DeepSpeed checkpoint has no param_order: it is DeepSpeed's already.
    conv = fixture_root / "conv"
    if not conv.exists():
        pytest.skip("needs the converted fixture")
    with pytest.raises(CheckpointError, match="has no 'param_order'"):
        export_deepspeed(conv, tmp_path / "out")


def test_export_reads_back_at_other_worlds(tmp_path: Path) -> None:
    """Without DeepSpeed: a slipstream ZeRO-2 checkpoint of world 2 exported for DeepSpeed
    worlds 1 and 3 at ZeRO-1 and ZeRO-3 (cut into sub-groups of 20 elements) reads back (through the DeepSpeed reader) with every weight and Adam state
    equal, the counters and the client state kept."""
    run_world(w.slipstream_saves, 2, str(tmp_path), 2)
    saved = CheckpointReader(next((tmp_path / "ss").glob("global_step*")))
    # Adam's 0-d step beside a one-element piece (0.bias here) stays a per-group scalar.
    assert saved.manifest["optim_keys"] == ["exp_avg", "exp_avg_sq"]
    for world, stage in ((1, 1), (3, 1), (1, 3), (3, 3)):
        out = export_deepspeed(
            tmp_path / "ss", tmp_path / f"to_ds{world}_{stage}", world, stage, sub_group_size=20
        )
        back = DeepSpeedReader(out)
        assert len(list(out.glob("zero_pp_rank_*_optim_states.pt"))) == world
        assert sorted(back.names("model")) == sorted(saved.names("model"))
        for name in saved.names("model"):
            for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
                got, want = back.read_full(f"{kind}/{name}"), saved.read_full(f"{kind}/{name}")
                assert torch.equal(got, want), (world, kind, name)
            assert torch.equal(back.read_full(f"master/{name}"), saved.read_full(f"model/{name}"))
        m = back.manifest
        assert (m["global_steps"], m["global_samples"], m["zero_stage"]) == (w.SAVED, 24, stage)
        assert m["optim_scalars"]["0"]["step"]["value"] == w.SAVED
        assert back.load_object("extra.pt")["client_state"]["epoch"] == 7
