"""``parallelize_tp_(model, tp_group)``: split a model's layers over the TP group, in place.

Every rank must hold the same full weights before the call; TP rank 0's are broadcast and each
rank keeps its slices. The plan comes from the caller, else from the model's own
``tp_plan(sequence_parallel)`` method, else from :func:`auto_tp_plan`: there is no other route,
the function never looks at a model's class.

Random ops between a column-parallel output and the row-parallel input (attention dropout on
the local heads) draw from the per-rank stream of an RNG tracker (``slipstream.parallel.random``)
so the TP ranks drop different elements; those on replicated activations use the default
stream, equal on all TP ranks. The tracker is passed in (``slipstream.initialize`` gives each
engine its own); by default it is the process-wide one of the DeepSpeed/Megatron API.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.distributed.placement import mark_tp_grad_summed_, tp_grad_summed
from slipstream.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker
from slipstream.parallel.tensor.collectives import all_reduce
from slipstream.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from slipstream.parallel.tensor.plan import TPPlan, auto_tp_plan

__all__ = ["parallelize_tp_", "replace_module_"]


def parallelize_tp_(
    model: nn.Module,
    tp_group: comm.Group,
    plan: TPPlan | None = None,
    sequence_parallel: bool = False,
    rng_tracker: RNGStatesTracker | None = None,
    skeleton: bool = False,
) -> nn.Module:
    """Split ``model``'s layers over ``tp_group`` in place (parameter objects and names kept).

    Args:
        model: a model on its device (not yet sharded by ZeRO; no meta parameters).
        tp_group: the tensor-parallel process group (``mesh.get_group("tp")``).
        plan: which module gets which split; default: the model's own
            ``tp_plan(sequence_parallel)`` if it has one (slipstream's GPT, a
            ``PipelineModule``), else :func:`auto_tp_plan`.
        sequence_parallel: split the residual stream along the sequence between layers
            (needs a plan that handles it; the sequence length must be a multiple of the TP
            size).
        rng_tracker: the tracker whose per-rank stream the sharded regions draw from
            (default: the process-wide ``get_rng_tracker()``); seeded here if it has no
            stream yet.
        skeleton: ``model`` is on the meta device: split the shapes only (no broadcast) and
            let the caller fill each rank's slices afterwards (the hybrid engine builds its
            tensor-parallel generation copy this way, a few gathered layers at a time, so no
            rank ever holds the whole model).

    Every rank must hold the same full weights before the call (same seed, or loaded).
    Returns the model.
    """
    world = comm.get_world_size(tp_group)
    if world == 1:
        return model
    # A meta parameter, or one partitioned by zero.Init (it has DeepSpeed's ds_id).
    meta = [n for n, p in model.named_parameters() if p.is_meta or hasattr(p, "ds_id")]
    if meta and not skeleton:
        raise ConfigError(
            f"tensor parallelism needs full weights on every rank, but {meta[0]!r} is on the "
            "meta device or partitioned (built under zero.Init?): build the model normally; "
            "ZeRO-3 still shards it over the data-parallel ranks after the TP split"
        )
    plan = plan if plan is not None else _model_plan(model, sequence_parallel)
    if sequence_parallel and not plan.sequence_parallel:
        raise ConfigError(
            "tensor_parallel.sequence_parallel needs a plan with sequence-parallel norms (the "
            f"reference GPT); {type(model).__name__} uses an automatic plan: set "
            "tensor_parallel.sequence_parallel to false"
        )
    tracker = rng_tracker if rng_tracker is not None else get_rng_tracker()
    if not tracker.has(MODEL_PARALLEL_RNG):
        tracker.add(
            MODEL_PARALLEL_RNG, torch.initial_seed() % 2**62 + 2718 + comm.get_rank(tp_group)
        )
    _check_heads(model, plan, world)
    # Every TP rank slices the same full weights: take TP rank 0's.
    if not skeleton:
        _broadcast_weights(model, tp_group)
    for name, style in plan.styles.items():
        _apply_style(model, name, style, plan, tp_group, sequence_parallel, tracker)
    for name, attrs in plan.head_attrs.items():
        owner = model.get_submodule(name)
        for attr in attrs:
            setattr(owner, attr, getattr(owner, attr) // world)
    _sharded_region_hooks(model, plan, tracker)
    for step in plan.after_split:
        step(tp_group)
    # Read by save_16bit_model to gather the full tensors of the shards.
    model.tp_group = tp_group  # type: ignore[assignment]
    return model


def _broadcast_weights(model: nn.Module, tp_group: comm.Group) -> None:
    """Every TP rank slices the same full weights: take TP rank 0's."""
    src = comm.global_rank(tp_group, 0)
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            comm.broadcast(p.data, src=src, group=tp_group, label="tp_init")


def _model_plan(model: nn.Module, sequence_parallel: bool) -> TPPlan:
    """The model's own plan (its ``tp_plan`` method), else the automatic one."""
    own_plan = getattr(model, "tp_plan", None)
    if callable(own_plan):
        plan = own_plan(sequence_parallel)
        if not isinstance(plan, TPPlan):
            raise TypeError(
                f"{type(model).__name__}.tp_plan() returned {type(plan).__name__}, not a "
                "TPPlan: return slipstream.parallel.tensor.TPPlan"
            )
        return plan
    return auto_tp_plan(model)


def _apply_style(
    model: nn.Module,
    name: str,
    style: str,
    plan: TPPlan,
    group: comm.Group,
    sp: bool,
    tracker: RNGStatesTracker,
) -> None:
    """Give module ``name`` the treatment ``style`` (a parallel layer replaces it, or hooks)."""
    module = model.get_submodule(name)
    new: nn.Module | None = None
    if style == "colwise":
        new = ColumnParallelLinear.from_module(
            module, group, sequence_parallel=sp, fused_parts=plan.fused.get(name, 1)
        )
    elif style == "colwise_gather":
        new = ColumnParallelLinear.from_module(module, group, gather_output=True)
    elif style == "rowwise":
        new = RowParallelLinear.from_module(module, group, sequence_parallel=sp)
    elif style == "vocab_embed":
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"TP plan: {name!r} is {type(module).__name__}, not Embedding")
        new = VocabParallelEmbedding.from_module(module, group, sequence_parallel=sp)
    elif style == "sp_norm":
        for p in module.parameters():
            _sum_grad_over(p, group)
    elif style == "sp_dropout":
        _forked_dropout(module, tracker)
    else:
        raise ConfigError(f"TP plan: unknown style {style!r} for module {name!r}")
    if new is not None:
        replace_module_(model, name, new)


def _sharded_region_hooks(model: nn.Module, plan: TPPlan, tracker: RNGStatesTracker) -> None:
    """Random ops between a block's column-parallel outputs and its row-parallel input use
    the per-TP-rank RNG stream: entered after the first column layer runs, left when the row
    layer starts (per parent module, so attention and MLP regions are separate)."""
    regions: dict[str, ExitStack] = {}

    def parent_of(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""

    def enter(parent: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if parent not in regions:
                stack = ExitStack()
                stack.enter_context(tracker.fork(MODEL_PARALLEL_RNG))
                regions[parent] = stack

        return hook

    def leave(parent: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack = regions.pop(parent, None)
            if stack is not None:
                stack.close()

        return hook

    # A region ends at a row layer: column layers without one beside them (LM heads) open none.
    closed = {parent_of(n) for n, style in plan.styles.items() if style == "rowwise"}
    for name, style in plan.styles.items():
        if style == "colwise" and parent_of(name) in closed:
            model.get_submodule(name).register_forward_hook(enter(parent_of(name)))
        elif style == "rowwise":
            model.get_submodule(name).register_forward_pre_hook(leave(parent_of(name)))


def _forked_dropout(module: nn.Module, tracker: RNGStatesTracker) -> None:
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with tracker.fork(MODEL_PARALLEL_RNG):
            return forward(*args, **kwargs)

    module.forward = run  # type: ignore[method-assign]


def _sum_grad_over(p: nn.Parameter, group: comm.Group) -> None:
    """Each TP rank saw 1/tp of the tokens: the gradient is the sum over the group."""
    if tp_grad_summed(p):
        return  # shared by two norms (tied): one hook
    mark_tp_grad_summed_(p)
    p.register_hook(lambda g: all_reduce(g, group))


def _check_heads(model: nn.Module, plan: TPPlan, world: int) -> None:
    """Attention heads must split evenly (the weights alone cannot say where heads end)."""
    for name, attrs in plan.head_attrs.items():
        owner = model.get_submodule(name)
        for attr in attrs:
            value = getattr(owner, attr)
            if value % world:
                raise ConfigError(
                    f"tensor parallelism: {name}.{attr} = {value} is not divisible by "
                    f"tensor_parallel.autotp_size={world}: choose a TP size dividing it"
                )
    config = getattr(model, "config", None)
    for attr in ("num_heads", "num_kv_heads", "num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % world:
            raise ConfigError(
                f"tensor parallelism: model config {attr} = {value} is not divisible by "
                f"tensor_parallel.autotp_size={world}: every rank must hold whole heads; "
                "choose a TP size dividing it"
            )


def replace_module_(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where submodule ``name`` of ``model`` is (a plan's swap; names kept)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)
