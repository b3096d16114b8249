"""The reference GPT's MoE option: block placement, the aux loss in the loss, deterministic
(meta) initialisation, active-parameter FLOPs, and ep_size 2 training through initialize
equal to ep_size 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from slipstream.config._errors import ConfigError
from slipstream.models import GPT, GPTConfig, GPTMoEConfig
from slipstream.models.gpt_moe import MoEFeedForward
from tests.distributed.harness import run_world


def _config(**moe: Any) -> GPTConfig:
    return GPTConfig.preset("tiny", num_layers=4, moe=GPTMoEConfig(num_experts=4, **moe))


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_moe_blocks_and_aux_loss(capacity_factor: float | None) -> None:
    """Blocks 1 and 3 get experts (every=2); the loss is cross-entropy plus their aux losses."""
    torch.manual_seed(0)
    model = GPT(_config(capacity_factor=capacity_factor))
    kinds = [isinstance(b.mlp, MoEFeedForward) for b in model.layers]
    assert kinds == [False, True, False, True]
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(1)  # the same random token selection in both forwards
    logits = model(x)
    aux = sum(b.mlp.aux_loss for b in model.layers if isinstance(b.mlp, MoEFeedForward))
    torch.manual_seed(1)
    loss = model(x, x)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), x.reshape(-1))
    torch.testing.assert_close(loss, ce + aux)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_meta_construction_equals_eager(capacity_factor: float | None) -> None:
    cfg = _config(capacity_factor=capacity_factor)
    torch.manual_seed(3)
    eager = GPT(cfg)
    torch.manual_seed(3)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    for (n, a), b in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_flops_count_the_active_experts() -> None:
    """With k=1, a token uses one expert: FLOPs = the dense model's + the gates'."""
    dense = GPT(GPTConfig.preset("tiny", num_layers=4))
    for cf in (1.0, None):
        moe = GPT(_config(k=1, capacity_factor=cf))
        gates = 2 * 4 * dense.config.hidden_size  # two MoE layers, 4 experts
        assert moe.flops_per_token() == dense.flops_per_token() + 6 * gates


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="ep_size=3 must divide num_experts=4"):
        GPTMoEConfig(num_experts=4, ep_size=3)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        GPTConfig.preset("tiny", moe=GPTMoEConfig(), activation_checkpointing=True)


def _train(capacity_factor: float | None) -> dict[int, list[float]]:
    import slipstream

    rank = dist.get_rank()
    out = {}
    for ep in (1, 2):
        torch.manual_seed(0)
        ref = GPT(_config(k=2, capacity_factor=capacity_factor))
        torch.manual_seed(0)
        model = GPT(_config(k=2, capacity_factor=capacity_factor, ep_size=ep))
        state = ref.state_dict()
        local = 4 // ep
        for name in list(state):
            if ".deepspeed_experts." in name:
                head, rest = name.split(".deepspeed_experts.")
                gid, tail = rest.split(".", 1)
                lid = int(gid) - (rank % ep) * local
                value = state.pop(name)
                if 0 <= lid < local:
                    state[f"{head}.deepspeed_experts.{lid}.{tail}"] = value
            elif name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                state[name] = state[name][(rank % ep) * local : (rank % ep + 1) * local]
        model.load_state_dict(state)
        engine, _, _, _ = slipstream.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 1},
                "gradient_clipping": 1.0,
            },
        )
        g = torch.Generator().manual_seed(rank)
        losses = []
        for step in range(3):
            x = torch.randint(0, 256, (2, 16), generator=g)
            torch.manual_seed(100 * rank + step)  # top-2's Gumbel sampling draws the same
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[ep] = losses
        engine.destroy()
    return out


@pytest.mark.parametrize("capacity_factor", [None, 8.0])
def test_gpt_moe_ep2_trains_like_ep1(capacity_factor: float | None) -> None:
    """GPT with experts through slipstream.initialize (ZeRO-1, clipping): ep_size 2 gives
    ep_size 1's losses on every rank (no drops: dropless, or a capacity nothing exceeds)."""
    for res in run_world(_train, 2, capacity_factor):
        assert res[2] == pytest.approx(res[1], rel=1e-4)


def test_pipeline_layers_refuse_experts() -> None:
    """gpt_pipeline_layers would build blocks without their experts' auxiliary loss (and,
    with every=2, no experts at all): refused by name; the dense config still builds."""
    from slipstream.models.gpt_pipeline import gpt_pipeline_layers

    with pytest.raises(ConfigError, match=r"GPTConfig.moe = .* with gpt_pipeline_layers"):
        gpt_pipeline_layers(_config(k=1, capacity_factor=None))
    assert (
        len(gpt_pipeline_layers(GPTConfig.preset("tiny")))
        == GPTConfig.preset("tiny").num_layers + 3
    )
