"""The DeepSpeed module tree that DeepSpeed's own unit tests, Megatron-DeepSpeed and the
frameworks import: each module answers under SLIPSTREAM_AS_DEEPSPEED=1 with working names
(topology arithmetic, config classes under DeepSpeed's key names, op builders that build
nothing), and ``from deepspeed.X import Y`` behaves like ``import deepspeed.X.Y``."""

from __future__ import annotations

import warnings

import pytest

from slipstream.config import parse_config
from slipstream.distributed.process_topology import (
    PipeModelDataParallelTopology,
    ProcessTopology,
    prime_factors,
)
from slipstream.ops import __compatible_ops__, op_builder
from slipstream.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from slipstream.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from tests.compat.test_as_deepspeed import _python


def test_from_imports_of_redirected_submodules() -> None:
    proc = _python(
        """
        import slipstream
        from deepspeed.runtime import zero, pipe
        from deepspeed.launcher import runner
        import deepspeed.launcher.runner as runner2
        from deepspeed.runtime import config, engine
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        from deepspeed.git_version_info import torch_info, version
        from deepspeed.ops.op_builder import FusedAdamBuilder
        import deepspeed
        assert zero is slipstream.zero and pipe is slipstream.pipe and runner is runner2
        assert config.DeepSpeedConfigError is slipstream.ConfigError
        assert DeepSpeedEngine is slipstream.runtime.engine.Engine
        assert version == deepspeed.__version__
        assert deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME] is True
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_process_topology_is_row_major() -> None:
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 2, 2])
    assert topo.world_size() == 8
    assert [topo.get_rank(a=1, b=0, c=1), topo.get_rank(a=0, b=1, c=0)] == [5, 2]
    assert topo.get_coord(6) == topo.ProcessCoord(1, 1, 0)
    assert topo.get_axis_list("b", 1) == [2, 3, 6, 7]
    assert topo.filter_match(b=1, c=1) == [3, 7]
    assert topo.get_axis_comm_lists("a") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("z") == [] and topo.get_dim("z") == 0
    mp = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert mp.get_axis_names() == ["pipe", "data", "model"]
    assert mp.get_rank_repr(rank=5) == "model_01"
    assert mp.get_rank_repr(rank=5, omit_axes=[], inner_sep="+") == "pipe+01-data+00-model+01"
    assert prime_factors(360) == [2, 2, 2, 3, 3, 5]
    with pytest.raises(ValueError, match="give every axis"):
        topo.get_rank(a=0)


def test_zero_config_under_deepspeed_names() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = DeepSpeedZeroConfig(cpu_offload=True, cpu_offload_param=True)
        assert isinstance(cfg.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
        assert isinstance(cfg.offload_param, DeepSpeedZeroOffloadParamConfig)
        assert DeepSpeedZeroConfig(
            stage3_gather_fp16_weights_on_model_save=True
        ).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345).prefetch_bucket_size == 12345
    assert DeepSpeedZeroConfig(max_reuse_distance=7).max_reuse_distance == 7
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [0, 0, 0, 1]
    assert DeepSpeedZeroConfig().offload_param is None
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    with pytest.raises(ValueError, match="stag"):
        DeepSpeedZeroConfig(stag=1)


def test_deepspeed_config_object() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3},
        }
    )
    assert (cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization_stage) == (4, 3)
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 0.1}
    assert cfg.zero_config.overlap_comm and cfg.zero_enabled and not cfg.fp16_enabled
    assert cfg.gradient_clipping == 1.0
    with pytest.raises(DeepSpeedConfigError, match="train_batch_sise"):
        DeepSpeedConfig({"train_batch_sise": 8})


def test_op_builders_build_nothing() -> None:
    assert __compatible_ops__["fused_adam"] and __compatible_ops__["cpu_adam"]
    assert not __compatible_ops__["async_io"] and not __compatible_ops__["fused_lamb"]
    with pytest.raises(RuntimeError, match="not needed: slipstream compiles nothing"):
        op_builder.FusedAdamBuilder().load()
    with pytest.raises(RuntimeError, match="does not provide the DeepSpeed op 'quantizer'"):
        op_builder.QuantizerBuilder().load()
    assert op_builder.AsyncIOBuilder().is_compatible(verbose=True) is False


@pytest.mark.parametrize("value", ["FAIL", "fail", "Fail", "IGNORE", "warn"])
def test_tag_validation_any_case(value: str) -> None:
    cfg = parse_config({"train_batch_size": 1, "checkpoint": {"tag_validation": value}})
    assert cfg.checkpoint.tag_validation == value.capitalize()


def test_leaf_module_marks_and_optim_file_order(tmp_path) -> None:
    import torch

    from slipstream.accelerator import get_accelerator
    from slipstream.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )
    from slipstream.utils.zero_to_fp32 import get_optim_files

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    set_z3_leaf_modules(model, [torch.nn.Linear])
    assert get_z3_leaf_modules(model) == [model[0], model[2]] and z3_leaf_module(model[0])
    unset_z3_leaf_modules(model, [torch.nn.Linear])
    assert get_z3_leaf_modules(model) == [] and not z3_leaf_module(model[2])

    names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(12)]
    for n in reversed(names):
        (tmp_path / n).write_text(n)
    assert get_optim_files(tmp_path) == [str(tmp_path / n) for n in names]
    with pytest.raises(FileNotFoundError, match=r"_optim_states\.pt"):
        get_optim_files(tmp_path / "missing")
    t = torch.ones(3)
    assert get_accelerator().unpin_memory(t) is None  # DeepSpeed's torch backend: a no-op
