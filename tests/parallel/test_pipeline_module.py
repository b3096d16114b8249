"""PipelineModule and PipelineEngine in one process: partitioning (balanced, uniform, by
type), virtual chunks, the DeepSpeed surface (train_batch/eval_batch, pipeline config keys)
and every misuse error. Multi-process parity: test_pipeline_parity.py."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import ConfigError
from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers, load_gpt_weights_
from slipstream.parallel.pipeline import partition_balanced, partition_uniform
from slipstream.pipe import LayerSpec, PipelineError, PipelineModule
from tests.parallel import _pipe_workloads as w


def _brute_force(weights: list[float], parts: int) -> float:
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partitions_follow_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's rules: balanced = least spread between the heaviest and lightest run
    (latest cut on ties), uniform = the first runs one layer longer; DeepSpeed 0.19.8's own
    functions, when installed, agree on random weights."""
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]  # spread 0
    assert partition_balanced([1, 0, 1], 2) == [0, 2, 3]  # [0, 1, 3] ties: the later cut
    assert partition_balanced([0, 0, 1, 1], 2) == [0, 3, 4]
    assert partition_uniform(5, 2) == [0, 3, 5] and partition_uniform(8, 3) == [0, 3, 6, 8]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        partition_balanced([1.0, 1.0], 3)
    if importlib.util.find_spec("deepspeed") is None:
        return
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # import it without probing for a GPU
    utils = importlib.import_module("deepspeed.runtime.utils")
    g = torch.Generator().manual_seed(0)
    for n in range(1, 11):
        for parts in range(1, n + 1):
            for _ in range(3):
                weights = torch.randint(0, 6, (n,), generator=g).float().mul(97).tolist()
                bounds = partition_balanced(weights, parts)
                assert bounds == list(utils.partition_balanced(weights, parts)), weights
            assert partition_uniform(n, parts) == list(utils.partition_uniform(n, parts))


class _Big(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)


class _Small(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 1)


def _chunks(layers: list[Any], method: str, chunks: int) -> list[list[int]]:
    # One stage holding `chunks` model chunks: the layout of every stage's cuts in one process.
    module = PipelineModule(layers, num_stages=1, partition_method=method, virtual_stages=chunks)
    return module.stage_layers()


def test_partition_methods() -> None:
    """parameters: balance parameter counts (counted on meta); uniform: layer counts;
    type:regex: the matching layers."""
    kinds = [_Small, _Big, _Small, _Small, _Big, _Small, _Small, _Small]
    layers = [LayerSpec(k) for k in kinds]
    sizes = [17 if k is _Small else 272 for k in kinds]
    by_params = _chunks(layers, "parameters", 2)
    assert max(sum(sizes[i] for i in c) for c in by_params) == _brute_force(sizes, 2)
    assert [len(c) for c in _chunks(layers, "uniform", 3)] in ([3, 3, 2], [3, 2, 3], [2, 3, 3])
    for chunk in _chunks(layers, "type:_BIG", 2):  # case-insensitive
        assert sum(kinds[i] is _Big for i in chunk) == 1
    covered = [i for chunk in _chunks(layers, "uniform", 4) for i in chunk]
    assert covered == list(range(len(kinds)))


def test_module_errors() -> None:
    layers = [LayerSpec(_Big), LayerSpec(_Small)]
    with pytest.raises(
        ConfigError, match=r"num_stages=2 must be a positive divisor of the world size 1"
    ):
        PipelineModule(layers, num_stages=2)
    with pytest.raises(ConfigError, match="partition_method='best-ever' is unknown"):
        PipelineModule(layers, num_stages=1, partition_method="best-ever")
    with pytest.raises(
        ConfigError,
        match=r"the regex matches no layer class \(layer classes: \['_Big', '_Small'\]\)",
    ):
        PipelineModule(layers, num_stages=1, partition_method="type:attention")
    with pytest.raises(ConfigError, match="has 2 layers but num_stages=1 x virtual_stages=3"):
        PipelineModule(layers, num_stages=1, virtual_stages=3)
    with pytest.raises(TypeError, match="pass the class itself"):
        LayerSpec(_Big())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"topology=\.\.\.\) is not supported"):
        PipelineModule(layers, num_stages=1, topology=object())


def _gpt_module(**kwargs: Any) -> PipelineModule:
    module = PipelineModule(
        gpt_pipeline_layers(w.gpt_config()), num_stages=1, loss_fn=gpt_loss, **kwargs
    )
    load_gpt_weights_(module, w.reference_model().state_dict(), w.LAYERS)
    return module


def _config(micro_batches: int, **pipeline: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": w.MICRO,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "SGD", "params": {"lr": w.LR, "momentum": 0.9}},
        "pipeline": pipeline,
    }


def test_one_stage_engine_matches_plain_training_and_evaluates() -> None:
    """train_batch on one stage (DeepSpeed config keys included) equals plain training on the
    global batch; eval_batch returns the loss and the logits; forward/backward/step refuse."""
    m = 3
    engine, *_ = slipstream.initialize(
        model=_gpt_module(),
        config=_config(
            m,
            num_stages=1,
            partition="best",
            seed_layers=False,
            pipe_partitioned=True,
            grad_partitioned=True,
            activation_checkpoint_interval=2,
        ),
    )
    assert engine.pipe_module.activation_checkpoint_interval == 2
    it = w.micro_iter(m, 1, 0)
    losses = [engine.train_batch(it).item() for _ in range(3)]
    ref = w.reference_run(m, 1)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref["losses"][:3]), rtol=1e-5, atol=0
    )

    x, y = w.global_batches(w.MICRO * m)[0]
    data = iter(
        [(x[i * w.MICRO : (i + 1) * w.MICRO], y[i * w.MICRO : (i + 1) * w.MICRO]) for i in range(m)]
    )
    loss, logits = engine.eval_batch(data, return_logits=True)
    assert len(logits) == m and logits[0].shape == (w.MICRO, w.SEQ, w.VOCAB)
    want = torch.stack(
        [
            gpt_loss(lg, y[i * w.MICRO : (i + 1) * w.MICRO].to(lg.device))
            for i, lg in enumerate(logits)
        ]
    ).mean()
    torch.testing.assert_close(loss, want)

    with pytest.raises(PipelineError, match=r"call engine\.train_batch"):
        engine(x)
    with pytest.raises(PipelineError, match="train_batch"):
        engine.backward(loss)
    with pytest.raises(PipelineError, match="ran out after 0 of 3"):
        engine.train_batch(iter([]))
    with pytest.raises(PipelineError, match=r"an \(inputs, labels\) pair"):
        engine.train_batch(iter([x] * 3))
    engine.destroy()


@pytest.mark.parametrize(
    "module_kwargs,pipeline,match",
    [
        ({}, {"partition": "uniform"}, "'pipeline.partition' = 'uniform'"),
        ({}, {"seed_layers": True}, "PipelineModule\\(..., seed_layers=True\\)"),
        (
            {},
            {"stages": 2},
            "'pipeline.stages' = 2, but the PipelineModule was built with num_stages=1",
        ),
        ({}, {"schedule": "interleaved", "virtual_stages": 2}, "'pipeline.virtual_stages' = 2"),
        ({}, {"num_stages": 3}, "'pipeline.stages' = 3, but the PipelineModule"),
    ],
)
def test_pipeline_config_errors(
    module_kwargs: dict[str, Any], pipeline: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        slipstream.initialize(model=_gpt_module(**module_kwargs), config=_config(2, **pipeline))


def test_eval_options_and_batch_fn() -> None:
    """DeepSpeed's eval_batch(reduce_output=None, bcast_loss=...) and set_batch_fn."""
    m = 2
    engine, *_ = slipstream.initialize(model=_gpt_module(), config=_config(m))
    x, y = w.global_batches(w.MICRO * m)[0]
    dicts = [
        {"ids": x[i * w.MICRO : (i + 1) * w.MICRO], "labels": y[i * w.MICRO : (i + 1) * w.MICRO]}
        for i in range(m)
    ]
    engine.set_batch_fn(lambda b: (b["ids"], b["labels"]))
    per = engine.eval_batch(iter(dicts), reduce_output=None)
    avg = engine.eval_batch(iter(dicts), bcast_loss=False)
    assert per.shape == (m,) and per[0] != per[1]
    torch.testing.assert_close(per.mean(), avg)
    with pytest.raises(ValueError, match="reduce_output='sum'"):
        engine.eval_batch(iter(dicts), reduce_output="sum")
    assert torch.isfinite(engine.train_batch(iter(dicts)))  # the batch fn feeds training too
    engine.destroy()


def test_checkpointable_layers_limit_recompute() -> None:
    """activation_checkpoint_interval=1 recomputes every layer; checkpointable_layers keeps
    the others' activations: saved bytes none > blocks only > all, same loss."""
    results = {}
    for name, kwargs in {
        "none": {},
        "blocks": {"activation_checkpoint_interval": 1, "checkpointable_layers": ["GPTBlockLayer"]},
        "all": {"activation_checkpoint_interval": 1},
    }.items():
        engine, *_ = slipstream.initialize(model=_gpt_module(**kwargs), config=_config(1))
        loss = engine.train_batch(w.micro_iter(1, 1, 0))
        results[name] = (loss.item(), engine.activation_stats.peak_bytes)
        engine.destroy()
    assert results["none"][0] == results["blocks"][0] == results["all"][0]
    assert results["none"][1] > results["blocks"][1] > results["all"][1]


def test_deepspeed_pipe_names() -> None:
    """``import slipstream as deepspeed`` reaches the pipeline names DeepSpeed scripts use."""
    import slipstream as deepspeed

    assert deepspeed.pipe.PipelineModule is deepspeed.PipelineModule is PipelineModule
    assert deepspeed.pipe.LayerSpec is LayerSpec
    assert deepspeed.pipe.TiedLayerSpec.__mro__[1] is LayerSpec


def test_train_batch_reads_the_engines_loader_epoch_after_epoch() -> None:
    """initialize(training_data=...) then train_batch() with no iterator: the engine's own
    loader repeats (next epoch's order) instead of running out, as in DeepSpeed."""
    from slipstream.utils import RepeatingLoader

    x, y = w.global_batches(8, steps=1)[0]  # 8 samples: one epoch = 4 micro-batches of 2
    engine, _, loader, _ = slipstream.initialize(
        model=_gpt_module(),
        config=_config(2),
        training_data=torch.utils.data.TensorDataset(x, y),
    )
    losses = [engine.train_batch().item() for _ in range(5)]  # 2.5 epochs
    assert all(torch.isfinite(torch.tensor(losses)))
    assert isinstance(engine._data_iter, RepeatingLoader) and engine._data_iter.epoch == 2
    assert loader.sampler.epoch == 2
    engine.destroy()
    with pytest.raises(ValueError, match="yields no batches"):
        next(RepeatingLoader([]))
