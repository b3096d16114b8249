"""Rank side of tests/compat/test_trl_zero3.py: what TRL and Accelerate reach into on a ZeRO-3
engine, on 2 gloo ranks under ``SLIPSTREAM_AS_DEEPSPEED=1``.

1. TRL's ``unwrap_model_for_generation`` on an Accelerate-prepared ZeRO-3 engine (a tiny
   LLaMA): greedy ``generate`` inside it against the same model unpartitioned, the hooks
   taken off and put back, the parameters released after, and a training step after that
   whose loss is the unpartitioned model's.
2. ``deepspeed.runtime.zero.linear.LinearModuleForZeroStage3`` trained at ZeRO-3 against
   ``nn.Linear`` in one process on the global batch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._tiny_models import tiny_llama

VOCAB = 48
PROMPT = 5
NEW_TOKENS = 8


def _tiny_llama() -> nn.Module:
    return tiny_llama(0, vocab=VOCAB, hidden=32, pad=0, bos=1, eos=2, eval=False)


def _zero3_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _generate(model: nn.Module, prompt: torch.Tensor) -> list[list[int]]:
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,  # always NEW_TOKENS tokens
        pad_token_id=0,
    )
    return out[:, PROMPT:].tolist()


def trl_unwrap() -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from trl.models.utils import unwrap_model_for_generation

    rank = dist.get_rank()
    model = _tiny_llama()
    reference = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (2, PROMPT), generator=g)
    expected = _generate(reference, prompt)

    plugin = DeepSpeedPlugin(hf_ds_config=_zero3_config())
    accelerator = Accelerator(deepspeed_plugin=plugin)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay
    engine, optimizer = accelerator.prepare(model, optimizer)
    offload = engine.optimizer.parameter_offload
    hooks_before = len(offload.forward_hooks)
    embed = engine.module.model.embed_tokens.weight
    released_before = embed.numel() == 0
    with unwrap_model_for_generation(engine, accelerator) as unwrapped:
        hooks_inside = len(offload.forward_hooks)
        gathered_inside = embed.numel() == VOCAB * 32
        got = _generate(unwrapped, prompt)
    released_after = embed.numel() == 0
    hooks_after = len(offload.forward_hooks)
    # TRL's ds3_gather_for_generation=False: generate through the ZeRO-3 hooks, which gather
    # each unit for its forward and release it after.
    with unwrap_model_for_generation(
        engine, accelerator, gather_deepspeed3_params=False
    ) as unwrapped:
        got_ungathered = _generate(unwrapped, prompt)

    batch = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(9 + rank))
    engine.train()
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        ref_loss = reference(input_ids=batch, labels=batch).loss
    return {
        "expected": expected,
        "got": got,
        "got_ungathered": got_ungathered,
        "hooks": (hooks_before, hooks_inside, hooks_after),
        "released": (released_before, gathered_inside, released_after),
        "loss": (loss.item(), ref_loss.item()),
    }


def zero3_linear() -> dict[str, Any]:
    """Two ``LinearModuleForZeroStage3`` layers at ZeRO-3 (rank r takes rows r*2:(r+1)*2),
    and ``nn.Linear`` layers from the same values in this process on all 4 rows."""
    import slipstream
    from slipstream.zero.linear import LinearModuleForZeroStage3

    torch.manual_seed(1)
    model = nn.Sequential(
        LinearModuleForZeroStage3(6, 8), nn.Tanh(), LinearModuleForZeroStage3(8, 1)
    )
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(2)
    ours, theirs = [], []
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = nn.functional.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        ours.append(float(loss))
        with torch.no_grad():
            theirs.append(float(nn.functional.mse_loss(reference(x[mine]), y[mine])))
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()  # the mean of the two halves'
        ref_opt.step()
    return {"losses": ours, "reference": theirs, "released_weight": _released_weight()}


def _released_weight() -> dict[str, Any]:
    """``zero3_linear_wrap`` on a weight used inside a ``GatheredParameters`` block that has
    ended before the backward (so the weight is released when its backward runs): the
    gradients and the SGD step equal the one-process ones."""
    import slipstream
    from slipstream.zero import GatheredParameters
    from slipstream.zero.linear import zero3_linear_wrap

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 8, bias=False))
    start = model[0].weight.detach().clone()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    w = engine.module[0].weight
    rank = dist.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    mine = x[2 * rank : 2 * rank + 2].clone().requires_grad_(True)
    with GatheredParameters([w]):
        out = zero3_linear_wrap(mine, w)
    released = w.numel() == 0
    engine.backward(out.square().mean())
    engine.step()
    ref_w = start.clone().requires_grad_(True)
    ref_x = x[2 * rank : 2 * rank + 2].clone().requires_grad_(True)
    nn.functional.linear(ref_x, ref_w).square().mean().backward()
    full_w = start.clone().requires_grad_(True)
    # the data-parallel mean of the two ranks' losses
    torch.stack(
        [nn.functional.linear(x[i : i + 2], full_w).square().mean() for i in (0, 2)]
    ).mean().backward()
    assert full_w.grad is not None
    with GatheredParameters([w]):
        stepped = w.detach().clone()
    return {
        "released": released,
        "input_grad": float((mine.grad - ref_x.grad).abs().max()),  # type: ignore[operator]
        "weight": float((stepped - (start - 0.1 * full_w.grad)).abs().max()),
    }


def all_cases(with_trl: bool) -> dict[str, Any]:
    return {"trl": trl_unwrap() if with_trl else None, "linear": zero3_linear()}
