"""Expert parallelism composed with pipeline parallelism: a PipelineModule whose first stage
holds DeepSpeed's MoE layer at ep_size 2, on PP2 x DP2 (4 gloo ranks; the expert-parallel
group is the stage's data-parallel group), trains like one process holding every expert on
the same global batch: losses and parameters after 3 clipped SGD steps at ZeRO-1 and ZeRO-3.
The routing is uneven across the data-parallel ranks and one expert receives no token."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.harness import run_world

DIM, EXPERTS, STEPS, MICRO_BATCHES, MICRO, LR, CLIP = 8, 4, 3, 2, 2, 0.05, 0.2
STAGES = (1, 3)


class MoEBlock(nn.Module):
    """A residual MoE block that returns hidden states only (a pipeline layer passes one
    tensor on; the auxiliary loss is left out here and in the reference alike)."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import MoE

        expert = nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep_size, k=1, drop_tokens=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)[0]


def _layers(ep_size: int) -> list[nn.Module]:
    return [MoEBlock(ep_size), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)]


def _reference() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(*_layers(1))
    with torch.no_grad():  # positive inputs, expert 3's gate row negative: it gets nothing
        wg = net[0].moe.deepspeed_moe.gate.wg.weight
        wg.abs_().mul_(3)
        wg[3] = -wg[3]
    return net


def _micro(step: int, dp_rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + mb)
    scale = torch.linspace(0.2, 2.0, DIM) if dp_rank == 0 else torch.linspace(2.0, 0.2, DIM)
    x = torch.rand(MICRO, 6, DIM, generator=g) * scale + 0.05
    return x, torch.randn(MICRO, 6, DIM, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _reference_run(dp: int) -> dict[str, Any]:
    """One process: each step's loss is the mean over every rank's micro-batches."""
    net = _reference()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        micro = [_micro(step, r, mb) for r in range(dp) for mb in range(MICRO_BATCHES)]
        loss = sum(_loss(net(x), y) for x, y in micro) / len(micro)
        loss.backward()  # type: ignore[union-attr]
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": net.state_dict(), "norms": norms}


def _global_name(name: str, ep_rank: int) -> str:
    if ".deepspeed_experts." not in name:
        return name
    head, rest = name.split(".deepspeed_experts.")
    lid, tail = rest.split(".", 1)
    return f"{head}.deepspeed_experts.{int(lid) + ep_rank * EXPERTS // 2}.{tail}"


def _run(stage: int) -> dict[str, Any]:
    import slipstream
    from slipstream.parallel.pipeline.module import LayerSpec, PipelineModule

    specs = [LayerSpec(MoEBlock, 2), *(LayerSpec(nn.Linear, DIM, DIM) for _ in range(3))]
    module = PipelineModule(specs, num_stages=2, loss_fn=_loss)
    dp_rank = dist.get_rank() % 2  # pp is the outer mesh axis: ranks 0,1 stage 0
    ref = _reference().state_dict()
    module.load_state_dict({n: ref[_global_name(n, dp_rank)] for n in module.state_dict()})
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    losses, counts = [], []
    for step in range(STEPS):
        data = iter([_micro(step, dp_rank, mb) for mb in range(MICRO_BATCHES)])
        losses.append(float(engine.train_batch(data)))
        moe = [m for m in engine.module.modules() if isinstance(m, MoEBlock)]
        counts.append(moe[0].moe.deepspeed_moe.exp_counts.clone() if moe else None)
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {
            _global_name(n, dp_rank): p.detach().clone()
            for n, p in engine.module.state_dict().items()
        }
    engine.destroy()
    return {"losses": losses, "params": params, "counts": counts}


def world() -> dict[Any, Any]:
    out: dict[Any, Any] = {stage: _run(stage) for stage in STAGES}
    out["reference"] = _reference_run(2)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_world(world, 4, timeout_s=300)


@pytest.mark.parametrize("stage", STAGES)
def test_pp2_dp2_ep2_equals_one_process(ranks: list[dict[Any, Any]], stage: int) -> None:
    """Losses (rtol 1e-5) and this stage's parameters, its experts by global id (1e-6)."""
    seen: set[str] = set()
    for res in ranks:
        ref = res["reference"]
        assert res[stage]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for name, p in res[stage]["params"].items():
            torch.testing.assert_close(p, ref["params"][name], rtol=1e-5, atol=1e-6)
        seen.update(res[stage]["params"])
    assert seen == set(ranks[0]["reference"]["params"])  # every expert held by some rank


def test_routing_was_uneven_with_an_idle_expert(ranks: list[dict[Any, Any]]) -> None:
    """The stage-0 ranks routed different counts, expert 3 got none, and clipping acted."""
    c0, c1 = ranks[0][1]["counts"][0], ranks[1][1]["counts"][0]
    assert not torch.equal(c0, c1)
    assert int(c0[3]) == int(c1[3]) == 0
    assert min(ranks[0]["reference"]["norms"]) > CLIP
