"""The names DeepSpeed's own unit tests import, checked against DeepSpeed 0.19.8 itself (when
installed): pipeline schedules, partition helpers, launcher resource filters, expert-parallel
rank lists, ZeRO leaf marking, OneCycle/WarmupLR per group, DeepSpeedConfigModel, core lists.
All pure functions: no process group, one import of each library."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch
from pydantic import Field, ValidationError

import slipstream.launcher.runner as our_runner
import slipstream.pipe.schedule as our_sched
from slipstream.optim.schedules import OneCycle, WarmupLR
from slipstream.runtime import utils as our_utils
from slipstream.runtime.config_utils import DeepSpeedConfigModel
from slipstream.utils import groups as our_groups
from slipstream.utils.numa import parse_range_list
from slipstream.utils.timer import trim_mean
from slipstream.zero import leaf_modules as our_leaf


@pytest.fixture(scope="module")
def ds() -> Any:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    from tests.compat._deepspeed import import_deepspeed

    mod = import_deepspeed()
    if getattr(mod, "__slipstream_version__", None):
        pytest.skip("deepspeed is slipstream here (SLIPSTREAM_AS_DEEPSPEED=1)")
    return mod


def _steps(schedule: Any) -> list[list[str]]:
    return [[repr(cmd) for cmd in step] for step in schedule]


def test_pipeline_schedules_yield_deepspeeds_instruction_streams(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.runtime.pipe.schedule")
    for kind in ("TrainSchedule", "InferenceSchedule", "DataParallelSchedule"):
        for stages in (1, 2, 3, 4):
            for micro in (1, 2, 3, 5, 8):
                for stage in range(stages):
                    args = {"micro_batches": micro, "stages": stages, "stage_id": stage}
                    ours, ref = getattr(our_sched, kind)(**args), getattr(theirs, kind)(**args)
                    assert _steps(ours) == _steps(ref), (kind, args)
                    assert ours.num_pipe_buffers() == ref.num_pipe_buffers()
    with pytest.raises(TypeError):  # abstract, as DeepSpeed's
        our_sched.PipeSchedule(micro_batches=1, stages=1, stage_id=0)  # type: ignore[abstract]


def test_partition_helpers_match_deepspeeds(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.runtime.utils")
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 9):
        for parts in range(1, 7):
            assert our_utils.partition_uniform(n, parts) == list(theirs.partition_uniform(n, parts))
            weights = torch.randint(0, 5, (n,), generator=gen).tolist()
            assert our_utils.partition_balanced(weights, num_parts=parts) == list(
                theirs.partition_balanced(weights=weights, num_parts=parts)
            ), (weights, parts)
    assert our_utils.prefix_sum_inc([3, 4, 5]) == theirs.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert our_utils.call_to_str("f", 1, "a", k=2) == theirs.call_to_str("f", 1, "a", k=2)


def test_launcher_resource_filters_match_deepspeeds(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.launcher.runner")
    hosts = {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    cases = [
        ("", ""),
        ("w1:0,3", ""),
        ("w0:1@w0:0,1", ""),
        ("w0", ""),
        ("w1@w0:2", ""),
        ("", "w1"),
        ("", "w0:0,1@w1:3"),
        ("", "w0@w1"),
        ("", "w0:1,1"),
        ("jeff", ""),
        ("", "w1:4"),
        ("w1@w0:1@5", ""),
        ("A", "B"),
    ]
    for include, exclude in cases:
        outcome = []
        for fn in (our_runner.parse_resource_filter, theirs.parse_resource_filter):
            try:
                outcome.append(dict(fn(hosts, include_str=include, exclude_str=exclude)))
            except ValueError:
                outcome.append("ValueError")
        assert outcome[0] == outcome[1], (include, exclude, outcome)
    pool = {"w0": 2, "w1": 3}
    assert our_runner.parse_inclusion_exclusion(pool, "w1:2", "") == dict(
        theirs.parse_inclusion_exclusion(pool, "w1:2", "")
    )
    lines = ["# c", "w0 slots=2", "", "10.0.0.1 slots=4"]
    assert our_runner._parse_hostfile(lines) == dict(theirs._parse_hostfile(lines))
    for bad in (["w0 slots=1", "w0 slots=2"], ["missingslots"], [""]):
        with pytest.raises(ValueError):
            our_runner._parse_hostfile(bad)
    world = {"w0": [0, 1], "w1": [0]}
    assert our_runner.encode_world_info(world) == theirs.encode_world_info(world)


def test_expert_parallel_rank_lists_match_deepspeeds(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.utils.groups")
    for world, tp, ep, pp in [
        (16, 2, 4, 1),
        (8, 1, 2, 1),
        (8, 2, 2, 2),
        (12, 1, 3, 2),
        (4, 1, 4, 1),
    ]:
        for before in (False, True):
            args = (world, tp, ep, pp, before)
            assert our_groups._get_expert_parallel_ranks(
                *args
            ) == theirs._get_expert_parallel_ranks(*args), args


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Inner()
        self.head = torch.nn.Linear(2, 2)


def test_leaf_marking_matches_deepspeeds(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.utils.z3_leaf_module")
    qualified = f"{_Inner.__module__}.{_Inner.__qualname__}"
    calls = [
        ("set_z3_leaf_modules", ([qualified],), {}),
        ("set_z3_leaf_modules", (["_Inner", torch.nn.Linear],), {}),
        ("set_z3_leaf_modules", (["Missing"],), {"raise_if_not_found": False}),
        ("set_z3_leaf_modules_by_name", (["block", "nope"],), {"raise_if_not_found": False}),
        ("set_z3_leaf_modules_by_suffix", (["lin", "zz"],), {"raise_if_not_found": False}),
    ]
    for name, args, kwargs in calls:
        ours_model, ref_model = _Outer(), _Outer()
        ours = getattr(our_leaf, name)(ours_model, *args, **kwargs)
        ref = getattr(theirs, name)(ref_model, *args, **kwargs)
        names = dict(ours_model.named_modules())
        ids = {id(m): n for n, m in names.items()}
        ref_ids = {id(m): n for n, m in ref_model.named_modules()}
        if isinstance(ours, tuple):
            assert [ids[id(m)] for m in ours[0]] == [ref_ids[id(m)] for m in ref[0]]
            assert ours[1] == ref[1]
        else:
            assert [ids[id(m)] for m in ours] == [ref_ids[id(m)] for m in ref]
        marked = [n for n, m in ours_model.named_modules() if our_leaf.z3_leaf_module(m)]
        ref_marked = [n for n, m in ref_model.named_modules() if theirs.z3_leaf_module(m)]
        assert marked == ref_marked, name
    with pytest.raises(ValueError):
        our_leaf.set_z3_leaf_modules(_Outer(), ["Missing"])


def _two_groups() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    return torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])


def test_one_cycle_and_warmup_per_group_match_deepspeeds(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.runtime.lr_schedules")
    kwargs: dict[str, Any] = {
        "cycle_min_lr": [0.001, 0.002],
        "cycle_max_lr": [0.01, 0.02],
        "cycle_min_mom": [0.8, 0.85],
        "cycle_max_mom": [0.9, 0.95],
        "cycle_first_step_size": 4,
        "cycle_second_step_size": 6,
        "decay_step_size": 2,
        "decay_lr_rate": 0.5,
        "decay_mom_rate": 0.1,
    }
    runs = []
    for cls in (OneCycle, theirs.OneCycle):
        opt = _two_groups()
        sched = cls(opt, **kwargs)
        trace = []
        for _ in range(14):
            sched.step()
            trace += [v for g in opt.param_groups for v in (g["lr"], g["betas"][0])]
        runs.append((trace, sched.step_ratio))
    assert runs[0][1] == pytest.approx(runs[1][1])
    assert runs[0][0] == pytest.approx(runs[1][0])
    lrs = []
    for cls in (WarmupLR, theirs.WarmupLR):
        opt = _two_groups()
        sched = cls(opt, warmup_num_steps=5)
        sched.step(3)
        lrs.append([g["lr"] for g in opt.param_groups])
    assert lrs[0] == pytest.approx(lrs[1])
    for bad in ({"cycle_second_step_size": -1}, {"cycle_min_mom": [0.8, 0.8, 0.8]}):
        with pytest.raises(ValueError):
            OneCycle(_two_groups(), 0.001, 0.01, cycle_first_step_size=4, **bad)


def test_deepspeed_config_model_handles_deprecated_alias_and_auto(ds: Any) -> None:
    theirs = importlib.import_module("deepspeed.runtime.config_utils").DeepSpeedConfigModel

    def make(base: type) -> type:
        class Conf(base):  # type: ignore[misc, valid-type]
            a: int = 0
            old: str | None = Field(
                None,
                json_schema_extra={
                    "deprecated": True,
                    "new_param": "new",
                    "new_param_fn": lambda x: len(x or ""),
                },
            )
            new: int = 0
            c: int = Field(0, alias="c_alias")

        return Conf

    ours_cls, ref_cls = make(DeepSpeedConfigModel), make(theirs)
    for data in ({"a": 3}, {"old": "abcd"}, {"c_alias": 5}, {"c": 6}, {"a": "auto"}):
        assert ours_cls(**data).model_dump() == ref_cls(**data).model_dump(), data
    for bad in ({"a": "x"}, {"typo": 1}):
        for cls in (ours_cls, ref_cls):
            with pytest.raises(ValidationError):
                cls(**bad)
    for cls in (ours_cls, ref_cls):
        with pytest.raises(AssertionError):
            cls(old="ab", new=2)


def test_core_lists_and_trim_mean() -> None:
    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "1-2-3"):
        with pytest.raises(ValueError):
            parse_range_list(bad)
    data = [3.0, 1.0, 2.0, 100.0, 0.0]
    assert trim_mean(data, 0.2) == 2.0 and data == [3.0, 1.0, 2.0, 100.0, 0.0]


def test_leaf_module_block_marks_units_at_stage_3() -> None:
    from slipstream.config import parse_config
    from slipstream.zero.units import unit_modules

    cfg = parse_config(
        {
            "train_batch_size": 1,
            "zero_optimization": {"stage": 3, "leaf_module": {"names": "block", "classes": []}},
        }
    )
    assert cfg.zero_optimization.leaf_module.names == ["block"]
    model = _Outer()
    marked = our_leaf.apply_leaf_module_config(model, cfg.zero_optimization.leaf_module)
    assert marked == [model.block]
    assert any(m is model.block for _, m in unit_modules(model))
    assert not any(m is model.block for _, m in unit_modules(_Outer()))
    with pytest.raises(Exception, match="leaf_module"):
        parse_config({"train_batch_size": 1, "zero_optimization": {"leaf_module": {"x": 1}}})
