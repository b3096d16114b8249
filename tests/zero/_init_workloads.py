"""Rank-side checks of the ZeRO-3 parameter contract: zero.Init shards edited through
GatheredParameters before initialize, load_state_dict inside it, external parameters, and
every common access to a released parameter (run in spawned ranks: a crash fails the test)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.zero import GatheredParameters

STEPS = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "gradient_clipping": 0.0,  # the torch reference does not clip
}


def targets() -> dict[str, torch.Tensor]:
    """Weights a user loads into the model (differ from what initialization draws)."""
    torch.manual_seed(11)
    return {n: p.detach().clone() for n, p in GPT(GPTConfig.preset("tiny")).named_parameters()}


def _batches(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, 256, (2 * world, 16), generator=g)
        out.append([t[2 * r : 2 * r + 2] for r in range(world)])
    return out


def reference(world: int) -> dict[str, Any]:
    """Single process, plain AdamW, starting from ``targets()``."""
    model = GPT(GPTConfig.preset("tiny"))
    model.load_state_dict(targets())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in _batches(world):
        loss = sum(model(x, x) for x in step) / len(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _train(engine: Any) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in _batches(world):
        loss = engine(step[rank], step[rank])
        engine.backward(loss)
        engine.step()
        every = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(every, loss.detach())
        losses.append(torch.stack(every).mean().item())
    return losses


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def edited_before_initialize(how: str) -> dict[str, Any]:
    """Build under zero.Init, set the weights on rank 0 only inside
    GatheredParameters(modifier_rank=0) (``how``: "copy" in place or "load_state_dict"),
    rank 1 writing garbage that must be overwritten, then initialize and train."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    with slipstream.zero.Init():
        model = GPT(GPTConfig.preset("tiny"))
    params = list(model.parameters())
    shapes = {n: (tuple(p.shape), tuple(p.ds_shape), p.ds_numel, p.ds_tensor.numel())
              for n, p in model.named_parameters()}  # fmt: skip
    status = {p.ds_status for p in params}
    want = targets()
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        status_inside = {p.ds_status for p in params}
        if rank == 0 and how == "load_state_dict":
            model.load_state_dict(want)
        elif rank == 0:
            for n, p in model.named_parameters():
                p.copy_(want[n])
        else:
            for p in params:
                p.fill_(7.0)
    before = _gathered(model)
    engine, _, _, _ = slipstream.initialize(model=model, config=CONFIG)
    start = _gathered(engine.module)
    losses = _train(engine)
    final = _gathered(engine.module)
    engine.destroy()
    return {
        "shapes": shapes,
        "status": status,
        "status_inside": status_inside,
        "before": before,
        "start": start,
        "losses": losses,
        "final": final,
    }


class _Borrower(nn.Module):
    """A unit whose forward reads another unit's weight (it is not registered here)."""

    def __init__(self, lender: nn.Linear) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        object.__setattr__(self, "lender", lender)  # a plain reference, no submodule
        slipstream.zero.register_external_parameter(self, lender.weight)

    def reset_parameters(self) -> None:  # zero.Init initializes each module through it
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.lender.weight) * self.scale


def _borrowing_model() -> nn.Module:
    torch.manual_seed(2)
    first = nn.Linear(8, 8)
    return nn.Sequential(nn.ModuleList([first, _Borrower(first)]))


def _borrow_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    layers = model[0]
    return layers[1](layers[0](x)).square().mean()


def borrowing_reference(world: int) -> dict[str, torch.Tensor]:
    model = _borrowing_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(2 * world * 8, dtype=torch.float32).reshape(2 * world, 8) / 50
    loss = sum(_borrow_loss(model, x[2 * r : 2 * r + 2]) for r in range(world)) / world
    loss.backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def external_parameter() -> dict[str, torch.Tensor]:
    """register_external_parameter called while building under zero.Init; one SGD step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with slipstream.zero.Init():
        model = _borrowing_model()
    config = dict(CONFIG, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    x = torch.arange(2 * world * 8, dtype=torch.float32).reshape(2 * world, 8) / 50
    engine.backward(_borrow_loss(engine.module, x[2 * rank : 2 * rank + 2]))
    engine.step()
    out = _gathered(engine.module)
    engine.destroy()
    return out


def _touch(p: nn.Parameter) -> dict[str, Any]:
    """Every common read of a parameter outside forward; none may crash the process."""
    buf = io.StringIO()
    print(p, file=buf)
    return {
        "shape": tuple(p.shape),
        "numel": p.numel(),
        "ds_shape": tuple(p.ds_shape),
        "ds_numel": p.ds_numel,
        "status": p.ds_status,
        "norm": p.norm().item(),
        "sum": p.sum().item(),
        "isnan": bool(torch.isnan(p).any()),
        "clone": tuple(p.clone().shape),
        "detach_cpu": p.detach().cpu().tolist(),
        "repr": repr(p),
        "print": buf.getvalue(),
        "grad": p.grad,
    }


def released_access() -> dict[str, Any]:
    """After initialize and after a training step: touch every parameter; state_dict outside
    GatheredParameters; ds_status inside a forward, after it and inside GatheredParameters."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, opt, _, _ = slipstream.initialize(model=model, config=CONFIG)
    module = engine.module
    touched = {n: _touch(p) for n, p in module.named_parameters()}
    seen: dict[str, Any] = {}

    def look(mod: nn.Module, args: Any) -> None:
        seen["in_forward"] = mod.weight.ds_status, tuple(mod.weight.shape)

    handle = module.lm_head.register_forward_pre_hook(look)
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    handle.remove()
    after_step = {n: _touch(p) for n, p in module.named_parameters()}
    state_dict_sizes = sorted({v.numel() for v in module.state_dict().values()})
    with GatheredParameters(list(module.parameters())):
        inside = {n: (p.ds_status, tuple(p.shape)) for n, p in module.named_parameters()}
    shard_numel = sum(p.ds_tensor.numel() for p in module.parameters())
    engine.destroy()
    return {
        "full_shapes": {n: tuple(t.shape) for n, t in full.items()},
        "touched": touched,
        "after_step": after_step,
        "in_forward": seen["in_forward"],
        "state_dict_sizes": state_dict_sizes,
        "inside": inside,
        "ds_tensor_numel": shard_numel,
        "store_numel": sum(s.numel() for s in opt.store.shards),
    }


def read_inside_gathered() -> dict[str, Any]:
    """Issue 38: the common ways users read weights inside GatheredParameters (``.numpy()``,
    ``memoryview``, ``torch.from_numpy``, ``.tolist()``, ``.clone()``, a held ``state_dict()``
    and a cloned one), each kept past the block's exit; then train on and gather again."""
    torch.manual_seed(0)
    engine, _, _, _ = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=CONFIG)
    module = engine.module
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    params = list(module.named_parameters())
    with GatheredParameters([p for _, p in params]):
        want = {n: p.detach().clone() for n, p in params}
        arrays = {n: p.detach().numpy() for n, p in params}
        views = {n: memoryview(p.detach().numpy()) for n, p in params}
        shared = {n: torch.from_numpy(p.detach().numpy()) for n, p in params}
        lists = {n: p.tolist() for n, p in params}
        held = module.state_dict()
        copied = {k: v.clone() for k, v in module.state_dict().items()}
    kept = {
        "numpy": {n: torch.from_numpy(a.copy()) for n, a in arrays.items()},
        "memoryview": {n: torch.tensor(v.tolist()) for n, v in views.items()},
        "from_numpy": {n: t.clone() for n, t in shared.items()},
        "tolist": {n: torch.tensor(v) for n, v in lists.items()},
        "state_dict": {n: held[n].clone() for n in want},
        "state_dict_clone": {n: copied[n] for n in want},
    }
    engine.backward(engine(x, x))  # the units gather and release again after the hand-off
    engine.step()
    with GatheredParameters([p for _, p in params], modifier_rank=0):
        again = {n: p.detach().numpy().copy() for n, p in params}
    engine.destroy()
    return {
        "want": want,
        "kept": kept,
        "changed": {n: not (want[n].numpy() == a).all() for n, a in again.items()},
    }


def persistent_status() -> dict[str, Any]:
    """Issue 38: parameters of a unit under the persistence threshold (the root's 32832
    elements, not a block's 49280) hold their full data and say AVAILABLE (DeepSpeed's
    status for them), after initialize and after a step; the others are released. Built
    eagerly and under zero.Init."""
    out: dict[str, Any] = {}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 40_000}
    config = {**CONFIG, "zero_optimization": zero}
    for how in ("eager", "zero.Init"):
        torch.manual_seed(0)
        if how == "eager":
            model = GPT(GPTConfig.preset("tiny"))
        else:
            with slipstream.zero.Init(config_dict_or_path=config):
                model = GPT(GPTConfig.preset("tiny"))
        engine, _, _, _ = slipstream.initialize(model=model, config=config)
        seen = {"init": {n: (p.ds_status, tuple(p.shape), p.ds_numel)
                         for n, p in engine.module.named_parameters()}}  # fmt: skip
        x = torch.randint(0, 256, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
        seen["step"] = {n: (p.ds_status, tuple(p.shape), p.ds_numel)
                        for n, p in engine.module.named_parameters()}  # fmt: skip
        engine.destroy()
        out[how] = seen
    return out


def foreign_parameter() -> str:
    """A model holding a parameter partitioned by another ZeRO-3 (DeepSpeed's attributes)."""
    model = nn.Sequential(nn.Embedding(4, 2))
    w = model[0].weight
    w.data = torch.empty(0)
    w.ds_id, w.ds_shape, w.ds_status = 0, (4, 2), "NOT_AVAILABLE"
    try:
        slipstream.initialize(model=model, config=CONFIG)
    except RuntimeError as e:
        return str(e)
    return "no error"


def all_checks() -> dict[str, Any]:
    return {
        "copy": edited_before_initialize("copy"),
        "load_state_dict": edited_before_initialize("load_state_dict"),
        "external": external_parameter(),
        "released": released_access(),
        "foreign": foreign_parameter(),
        "read_inside": read_inside_gathered(),
        "persistent": persistent_status(),
    }
