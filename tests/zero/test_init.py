"""zero.Init: construction allocates no full model; the shards hold eager's values."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.zero import GatheredParameters, Init, ZeroParamStatus, materialize_
from tests.distributed.harness import run_fresh, run_world


def _full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_under_init_is_partitioned_with_eager_weights_bit_for_bit(tie):
    """In one process, Init partitions over a world of one: eager's weights, bit for bit."""
    cfg = GPTConfig.preset("tiny", tie_embeddings=tie)
    torch.manual_seed(3)
    eager = GPT(cfg)
    torch.manual_seed(3)
    had_group = dist.is_initialized()  # earlier tests in this process may have made one
    with Init() as ctx:
        model = GPT(cfg)
    assert dist.is_initialized() == had_group
    for (name, e), p in zip(eager.named_parameters(), model.parameters()):
        assert p.shape == (0,) and p.ds_shape == e.shape and p.ds_numel == e.numel(), name
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_tensor.numel() == e.numel()
    assert not model.rope_cos.is_meta  # buffers stay real
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    largest = max(p.ds_numel for p in model.parameters())
    assert largest <= ctx.peak_numel < sum(p.ds_numel for p in model.parameters())
    got = _full_values(model)
    for name, a in eager.named_parameters():
        assert torch.equal(a, got[name]), name
    x = torch.randint(0, 256, (2, 8))
    with GatheredParameters(list(model.parameters())):
        assert torch.equal(eager(x, x), model(x, x))


def _init_alone() -> bool:
    with Init():
        model = GPT(GPTConfig.preset("tiny"))
    assert not dist.is_initialized()
    return bool(next(model.parameters()).ds_tensor.numel() == next(model.parameters()).ds_numel)


def test_init_without_torch_distributed_makes_no_process_group():
    """A plain single process (no launcher, no group): Init runs as a world of one and
    creates no process group (a fresh process forked warm: tests before this one may have
    made one here)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = run_fresh(_init_alone, env=env, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.result is True


def test_materialize_keeps_working_on_a_meta_model():
    """materialize_ (the engine under Init) fills a model built on meta by hand."""
    torch.manual_seed(1)
    eager = nn.Linear(4, 8)
    torch.manual_seed(1)
    with torch.device("meta"):
        model = nn.Linear(4, 8)
    assert materialize_(model, "cpu") == 40
    assert torch.equal(model.weight, eager.weight) and torch.equal(model.bias, eager.bias)


def test_hf_model_under_init_gets_the_same_initializers():
    """HF models: _init_weights per module, so same distributions (not the same draws)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(cfg)
    with Init():
        model = transformers.LlamaForCausalLM(cfg)
    assert all(p.numel() == 0 for p in model.parameters())
    got = _full_values(model)
    for name, a in eager.named_parameters():
        b = got[name]
        if "norm" in name:
            assert torch.equal(a, b), name  # ones
        else:
            assert not torch.equal(a, b), name
            torch.testing.assert_close(b.std(), a.std(), rtol=0.15, atol=0, msg=name)


def test_plain_torch_modules_fall_back_to_reset_parameters_and_dtype_applies():
    torch.manual_seed(1)
    with Init(dtype=torch.bfloat16):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.ds_shape == (8, 4)
    got = _full_values(model)
    assert got["0.weight"].abs().max() <= 0.5 + 1e-3  # kaiming uniform bound 1/sqrt(4)
    assert got["0.weight"].std() > 0.05
    assert torch.equal(got["1.weight"], torch.ones(8, dtype=torch.bfloat16))


class _HeadAssignedFirst(nn.Module):
    """Built blocks-then-head, registered head-then-blocks (as Lightning's example model is):
    named_modules order differs from construction order."""

    def __init__(self) -> None:
        super().__init__()
        blocks = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6))
        head = nn.Linear(6, 3)
        self.head = head
        self.blocks = blocks


def test_plain_torch_model_gets_eager_weights_in_construction_order():
    """DeepSpeed initializes each layer as it is built; a plain-torch model under Init draws
    the same numbers as eager construction, even where registration order differs."""
    torch.manual_seed(7)
    eager = dict(_HeadAssignedFirst().named_parameters())
    torch.manual_seed(7)
    with Init():
        model = _HeadAssignedFirst()
    got = _full_values(model)
    assert list(got) == list(eager)
    for name, value in eager.items():
        assert torch.equal(got[name], value), name


def test_gathered_parameters_edits_land_in_the_shards_only_with_modifier_rank():
    with Init():
        model = nn.Sequential(nn.Linear(3, 2))
    w = model[0].weight
    with GatheredParameters(w, modifier_rank=0), torch.no_grad():
        w.fill_(2.0)
    with GatheredParameters([w]), torch.no_grad():
        assert w.ds_status is ZeroParamStatus.AVAILABLE and torch.equal(w, torch.full((2, 3), 2.0))
        w.fill_(5.0)  # no modifier_rank: discarded
    with GatheredParameters([w], modifier_rank=0):
        w.data = torch.full((2, 3), 3.0)  # assignment is kept too
    assert torch.equal(_full_values(model)["0.weight"], torch.full((2, 3), 3.0))
    bad_shape = r"shape \(2, 3\) was given a value of shape \(4,\)"
    with pytest.raises(ValueError, match=bad_shape), GatheredParameters([w], modifier_rank=0):
        w.data = torch.zeros(4)


def test_gathered_parameters_inside_an_open_init_partitions_what_was_built():
    """The DeepSpeed pattern of editing weights right after construction, inside Init."""
    with Init():
        layer = nn.Linear(2, 2)
        assert layer.weight.is_meta
        with GatheredParameters(layer.weight, modifier_rank=0), torch.no_grad():
            layer.weight.copy_(torch.eye(2))
        model = nn.Sequential(layer, nn.Linear(2, 1))
    assert torch.equal(_full_values(model)["0.weight"], torch.eye(2))
    assert model[1].weight.ds_shape == (1, 2)


def test_forward_before_initialize_is_an_error_with_directions():
    with Init():
        model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match=r"partitioned by zero.Init.*GatheredParameters"):
        model(torch.ones(1, 3))
    with GatheredParameters(list(model.parameters())):
        assert model(torch.ones(1, 3)).shape == (1, 2)


def test_a_parameter_partitioned_elsewhere_is_named_in_the_error():
    """A parameter with DeepSpeed's attributes but not slipstream's (a real DeepSpeed)."""
    p = nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_shape, p.ds_status = 7, (4, 4), "NOT_AVAILABLE"
    foreign = r"partitioned by another ZeRO-3 implementation"
    with pytest.raises(RuntimeError, match=foreign), GatheredParameters([p]):
        pass


def test_module_without_any_initializer_is_named_in_the_error():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    named = r"module '1' \(Scale\).*\['gain'\].*reset_parameters"
    with pytest.raises(TypeError, match=named), Init():
        nn.Sequential(nn.Linear(3, 3), Scale())
    assert not slipstream.zero.init.deferred_init_active()  # the failed Init was left


def test_init_rejects_options_it_does_not_implement():
    with pytest.raises(NotImplementedError, match="remote_device"):
        Init(remote_device="cpu")
    with pytest.raises(ValueError, match="stage = 2"):
        Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    with Init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta
    # Disabled, it checks nothing, as DeepSpeed's: Lightning's DeepSpeedStrategy enters
    # zero.Init(enabled=stage == 3, config_dict_or_path=<its stage-2 config>) at stage 2.
    with Init(enabled=False, config_dict_or_path={"zero_optimization": {"stage": 2}}):
        assert not nn.Linear(2, 2).weight.is_meta
    with Init(enabled=False, remote_device="cpu"):
        assert not nn.Linear(2, 2).weight.is_meta


def _train_first_losses(stage: int, deferred: bool) -> list[float]:
    torch.manual_seed(0)
    if deferred:
        with Init():
            model = GPT(GPTConfig.preset("tiny"))
    else:
        model = GPT(GPTConfig.preset("tiny"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _all_stages() -> dict[tuple[int, bool], list[float]]:
    return {(s, d): _train_first_losses(s, d) for s in (0, 3) for d in (False, True)}


def test_engine_trains_an_init_model_like_an_eager_one_at_every_stage():
    """One process: stage 0 materializes in full, stage 3 into shards; same losses."""
    (got,) = run_world(_all_stages, 1)
    for stage in (0, 3):
        assert got[(stage, True)] == got[(stage, False)], stage
