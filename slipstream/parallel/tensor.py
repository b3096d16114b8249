"""Tensor parallelism (Megatron-style), applied in place: ``parallelize_tp_(model, tp_group)``.

Each transformer layer's matrices are split across the ``tp`` ranks of a group so that a
layer needs two all-reduces in forward and two in backward:

- column-parallel linear (q/k/v, gate/up): weight rows split, the input is replicated, the
  output is this rank's slice of the features (``f``: identity forward, all-reduce backward);
- row-parallel linear (o_proj, down_proj): weight columns split, the input is the column
  layer's slice, the partial outputs are summed (``g``: all-reduce forward, identity backward);
- vocab-parallel embedding: rows of the table split by token id, lookups outside this rank's
  range give zero, partial results summed;
- the LM head is column-parallel over the vocabulary and :func:`vocab_parallel_cross_entropy`
  computes the loss from the vocabulary shards without a full [tokens, vocab] tensor.

With ``sequence_parallel=True`` (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", sec. 4.2.2), the residual stream between layers is split along
the sequence: norms and dropout run on 1/tp of the tokens, the all-reduces become a
reduce-scatter (after row-parallel layers and the embedding) and an all-gather (before
column-parallel layers) of the same volume, and the norm weights' gradients are summed over
the group.

The plan says which module gets which treatment: :func:`gpt_tp_plan` for slipstream's
reference GPT, :func:`auto_tp_plan` derived from module structure for Hugging Face models
(LLaMA-family, GPT-2 and others built the same way). Parameters keep their names and their
``nn.Parameter`` objects (their data becomes the local shard), so optimizers built earlier,
``named_parameters`` and checkpoints keep working; each sharded parameter's
:class:`~slipstream.distributed.placement.TPShard` (split dimension, rank, size) is what the
gradient norm and the checkpoint writer read.

Random ops between a column-parallel output and the row-parallel input (attention dropout on
the local heads) draw from the per-rank stream of ``slipstream.parallel.random`` so the TP
ranks drop different elements; those on replicated activations use the default stream, equal
on all TP ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.distributed.placement import (
    TPShard,
    mark_tp_grad_summed_,
    set_tp_shard_,
    tp_grad_summed,
    tp_shard,
)
from slipstream.parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPPlan",
    "VocabParallelEmbedding",
    "add_block_plan",
    "auto_tp_plan",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "gpt_tp_plan",
    "is_tp_sharded",
    "parallelize_tp_",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "unshard_tp",
    "vocab_parallel_cross_entropy",
]

Style = Literal["colwise", "rowwise", "vocab_embed", "colwise_gather", "sp_norm", "sp_dropout"]


# ------------------------------------------------------------------ collectives with autograd
def _flat_front(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
    """``x`` with ``dim`` moved first, contiguous and flat (fast gloo paths), and its shape."""
    moved = x.movedim(dim, 0).contiguous()
    return moved.reshape(-1), list(moved.shape)


def _all_reduce(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group, label="tp")
    return out


def _all_gather(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    world = comm.get_world_size(group)
    flat, shape = _flat_front(x, dim)
    out = torch.empty(flat.numel() * world, dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, flat, group=group, label="tp")
    shape[0] *= world
    return out.view(shape).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    world = comm.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"tensor-parallel reduce-scatter: dimension {dim} of shape {tuple(x.shape)} is not "
            f"divisible by the TP size {world}: with sequence parallelism the sequence length "
            "must be a multiple of tensor_parallel.autotp_size"
        )
    flat, shape = _flat_front(x, dim)
    out = torch.empty(flat.numel() // world, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, flat, group=group, label="tp")
    shape[0] //= world
    return out.view(shape).movedim(0, dim)


def _split(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(x.shape)} over {world} "
            "tensor-parallel ranks: make it a multiple of tensor_parallel.autotp_size"
        )
    return x.chunk(world, dim)[rank].contiguous()


_Op = Callable[[torch.Tensor, comm.Group, int], torch.Tensor]
_OPS: dict[str, _Op] = {
    "identity": lambda x, group, dim: x.view_as(x),
    "all_reduce": lambda x, group, dim: _all_reduce(x, group),
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "split": _split,
}


class _Exchange(torch.autograd.Function):
    """One collective forward and its adjoint backward, e.g. Megatron's ``f`` (identity,
    all-reduce) and ``g`` (all-reduce, identity), or sequence parallelism's all-gather /
    reduce-scatter pair."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: comm.Group, dim: int, fwd: str, bwd: str
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _OPS[fwd](x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _OPS[ctx.bwd](g, ctx.group, ctx.dim), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Entering a column-parallel layer: identity forward, all-reduce of the gradient."""
    return _Exchange.apply(x, group, 0, "identity", "all_reduce")


def reduce_from_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Leaving a row-parallel layer: all-reduce of the partial sums, identity backward."""
    return _Exchange.apply(x, group, 0, "all_reduce", "identity")


def gather_seq(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Sequence parallel, entering a column-parallel layer: all-gather the sequence, and
    reduce-scatter the gradient (each rank's columns contributed a partial sum)."""
    return _Exchange.apply(x, group, SEQ_DIM, "all_gather", "reduce_scatter")


def reduce_scatter_seq(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Sequence parallel, leaving a row-parallel layer: reduce-scatter the partial sums along
    the sequence, all-gather the gradient."""
    return _Exchange.apply(x, group, SEQ_DIM, "reduce_scatter", "all_gather")


def gather_from_tp(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over the TP group (differentiable)."""
    return _Exchange.apply(x, group, dim % x.dim(), "all_gather", "split")


SEQ_DIM = 1  # [batch, seq, hidden] activations


# ----------------------------------------------------------------------------------- layers
class _TPModule(nn.Module):
    group: comm.Group

    @property
    def tp_size(self) -> int:
        return comm.get_world_size(self.group)

    @property
    def tp_rank(self) -> int:
        return comm.get_rank(self.group)


def _shard_param_(p: nn.Parameter, dim: int, group: comm.Group, parts: int = 1) -> None:
    """Replace ``p``'s data by this rank's slice along ``dim`` (in place, same Parameter).

    ``parts > 1``: the dimension is a concatenation of ``parts`` equal blocks (fused q|k|v);
    each block is split and this rank keeps its slice of every block, in order.
    """
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    blocks = p.data.chunk(parts, dim)
    local = torch.cat([b.chunk(world, dim)[rank] for b in blocks], dim).contiguous()
    # swap_tensors, not .data: a parameter that already ran backward caches its old shape
    # in its gradient accumulator. The Parameter object (and its identity) stays.
    torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
    set_tp_shard_(p, TPShard(dim=dim, parts=parts, rank=rank, size=world))


class ColumnParallelLinear(_TPModule):
    """Linear layer with its output features split over the TP group.

    ``transposed``: the weight is stored [in, out] (Hugging Face ``Conv1D``).
    ``gather_output``: all-gather the output features (a full-width output on every rank).
    ``sequence_parallel``: the input is split along the sequence and is all-gathered first.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: comm.Group,
        transposed: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.transposed = group, transposed
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        group: comm.Group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        fused_parts: int = 1,
    ) -> ColumnParallelLinear:
        transposed = not isinstance(module, nn.Linear)
        weight: nn.Parameter = module.weight  # type: ignore[assignment]
        out_dim = 1 if transposed else 0
        _check_divisible(module, "output features", weight.shape[out_dim], group, fused_parts)
        if not getattr(weight, "_tp_sharded", False):  # a tied weight is split once
            _shard_param_(weight, out_dim, group, fused_parts)
            weight._tp_sharded = True  # type: ignore[attr-defined]
        bias = getattr(module, "bias", None)
        if bias is not None:
            _shard_param_(bias, 0, group, fused_parts)
        return cls(weight, bias, group, transposed, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        w = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, w, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, tp={self.tp_size}" + (
            ", gather_output" if self.gather_output else ""
        )


class RowParallelLinear(_TPModule):
    """Linear layer with its input features split over the TP group; partial outputs are
    all-reduced (or reduce-scattered along the sequence under sequence parallelism) before
    the bias is added once."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: comm.Group,
        transposed: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.transposed, self.sequence_parallel = group, transposed, sequence_parallel
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_module(
        cls, module: nn.Module, group: comm.Group, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        transposed = not isinstance(module, nn.Linear)
        weight: nn.Parameter = module.weight  # type: ignore[assignment]
        in_dim = 0 if transposed else 1
        _check_divisible(module, "input features", weight.shape[in_dim], group)
        _shard_param_(weight, in_dim, group)
        return cls(weight, getattr(module, "bias", None), group, transposed, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, w)
        y = (
            reduce_scatter_seq(y, self.group)
            if self.sequence_parallel
            else reduce_from_tp(y, self.group)
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, tp={self.tp_size}"


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by rows (token ids) over the TP group."""

    def __init__(
        self,
        weight: nn.Parameter,
        group: comm.Group,
        num_embeddings: int,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = weight
        self.num_embeddings = num_embeddings
        per = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * per, (self.tp_rank + 1) * per
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self.padding_idx = local_pad

    @classmethod
    def from_module(
        cls, module: nn.Embedding, group: comm.Group, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        weight: nn.Parameter = module.weight  # type: ignore[assignment]
        vocab = weight.shape[0]
        _check_divisible(module, "vocabulary rows", vocab, group)
        if not getattr(weight, "_tp_sharded", False):
            _shard_param_(weight, 0, group)
            weight._tp_sharded = True  # type: ignore[attr-defined]
        return cls(weight, group, vocab, module.padding_idx, sequence_parallel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(out, self.group)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}"


def _check_divisible(
    module: nn.Module, what: str, size: int, group: comm.Group, parts: int = 1
) -> None:
    world = comm.get_world_size(group)
    if size % (world * parts):
        raise ConfigError(
            f"tensor parallelism: {type(module).__name__} has {size} {what}, not divisible by "
            f"tensor_parallel.autotp_size={world}"
            + (f" x {parts} fused blocks" if parts > 1 else "")
            + ": choose a TP size that divides it (or resize the layer)"
        )


# ------------------------------------------------------------------------------- the loss
class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits [N, V/tp].

    Three small all-reduces of per-token values (max; target logit and sum of exponentials):
    no rank ever holds more than its [N, V/tp] shard, and backward reuses the saved local
    softmax in place.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: comm.Group, ignore: int
    ) -> torch.Tensor:
        vl = logits.shape[-1]
        start = comm.get_rank(group) * vl
        x = logits.float()
        x = x.clone() if x is logits else x  # work in place on our own fp32 copy
        row_max = x.max(dim=-1).values
        comm.all_reduce(row_max, op=comm.ReduceOp.MAX, group=group, label="tp_ce")
        x.sub_(row_max.unsqueeze(-1))
        mine = (labels >= start) & (labels < start + vl)
        idx = (labels - start).clamp(0, vl - 1).unsqueeze(-1)
        target = x.gather(-1, idx).squeeze(-1) * mine
        x.exp_()
        sums = torch.stack((target, x.sum(dim=-1)))
        comm.all_reduce(sums, group=group, label="tp_ce")
        target, sum_exp = sums[0], sums[1]
        valid = labels != ignore
        count = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / count
        x.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's vocabulary slice
        ctx.save_for_backward(x, idx, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        softmax, idx, mine, valid, count = ctx.saved_tensors
        g = softmax  # saved once, used once: update in place
        g.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(g.dtype))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: comm.Group, ignore_index: int = -100
) -> torch.Tensor:
    """Mean token cross-entropy from this rank's vocabulary slice of the logits.

    Args:
        logits: [..., V/tp] logits of vocabulary rows [rank * V/tp, (rank + 1) * V/tp).
        labels: [...] target ids in [0, V) (``ignore_index`` marks positions to skip).
        group: the tensor-parallel group (slices in rank order).

    Returns:
        The mean over non-ignored positions, equal on every TP rank; the same value as
        ``F.cross_entropy`` on the gathered logits.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: labels of shape {tuple(labels.shape)} do not match "
            f"logits of shape {tuple(logits.shape)} (expected labels {tuple(logits.shape[:-1])})"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, labels.reshape(-1), group, ignore_index)


# ------------------------------------------------------------------------------------ plans
@dataclass
class TPPlan:
    """Module name -> style; plus the model-level hooks a plan needs.

    Styles: "colwise", "rowwise", "colwise_gather" (column-parallel with the output
    gathered: a full-vocabulary LM head for models that compute their own loss),
    "vocab_embed", "sp_norm" (a norm on the sequence-split stream: gradients summed over the
    group) and "sp_dropout" (dropout on the sequence-split stream: per-rank RNG stream).
    ``fused``: module name -> number of equal blocks concatenated in its output (GPT-2's
    q|k|v), each split separately. ``head_attrs``: attention module name -> attribute names
    holding head counts or widths to divide by the TP size.
    """

    styles: dict[str, Style] = field(default_factory=dict)
    fused: dict[str, int] = field(default_factory=dict)
    head_attrs: dict[str, list[str]] = field(default_factory=dict)
    vocab_parallel_loss: bool = False
    """The model computes its loss with :func:`vocab_parallel_cross_entropy` (its LM head is
    plain "colwise"); it must have a ``set_tensor_parallel_group(group)`` method."""


_GPT_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_GPT_ROWWISE = ("o_proj", "down_proj")


def gpt_tp_plan(model: nn.Module, sequence_parallel: bool = False) -> TPPlan:
    """The plan of ``slipstream.models.GPT``: Megatron's split of attention and SwiGLU MLP,
    a vocab-parallel embedding and LM head with the vocab-parallel loss."""
    plan = TPPlan(vocab_parallel_loss=True)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _GPT_COLWISE:
            plan.styles[name] = "colwise"
        elif leaf in _GPT_ROWWISE:
            plan.styles[name] = "rowwise"
        elif name == "embed_tokens":
            plan.styles[name] = "vocab_embed"
        elif name == "lm_head":
            plan.styles[name] = "colwise"
        elif sequence_parallel and leaf in ("attn_norm", "mlp_norm", "norm"):
            plan.styles[name] = "sp_norm"
        elif sequence_parallel and isinstance(module, nn.Dropout):
            plan.styles[name] = "sp_dropout"
    return plan


_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "split_size")


def _is_linear(module: nn.Module) -> bool:
    # nn.Linear, or Hugging Face's Conv1D (weight [in, out], attribute nf = out features).
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    )


def _out_features(module: nn.Module) -> int:
    shape = module.get_parameter("weight").shape
    return int(shape[0] if isinstance(module, nn.Linear) else shape[1])


def _in_features(module: nn.Module) -> int:
    shape = module.get_parameter("weight").shape
    return int(shape[1] if isinstance(module, nn.Linear) else shape[0])


def auto_tp_plan(model: nn.Module) -> TPPlan:
    """A plan derived from module structure (AutoTP-style), for Hugging Face-like models.

    The transformer blocks are the largest ``nn.ModuleList``. In each block, linear layers are
    grouped by parent module (attention, MLP): the last one registered writes back to the
    residual stream and is row-parallel, the others are column-parallel. A column layer whose
    output is k times the row layer's input is k fused blocks (q|k|v). The input embedding is
    vocab-parallel and the output embedding (LM head) column-parallel with a gathered output,
    so the model's own loss sees full logits. Attention attributes holding head counts are
    divided by the TP size.
    """
    blocks = _largest_module_list(model)
    if blocks is None:
        raise ConfigError(
            f"automatic tensor parallelism found no transformer blocks (nn.ModuleList) in "
            f"{type(model).__name__}: give parallelize_tp_ an explicit TPPlan"
        )
    prefix, layers = blocks
    plan = TPPlan()
    for i, layer in enumerate(layers):
        add_block_plan(plan, layer, f"{prefix}.{i}")
    names = {m: n for n, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if isinstance(emb, nn.Embedding) and emb in names:
        plan.styles[names[emb]] = "vocab_embed"
    if head is not None and _is_linear(head) and head in names:
        plan.styles[names[head]] = "colwise_gather"
    return plan


def add_block_plan(plan: TPPlan, block: nn.Module, base: str) -> None:
    """Add the automatic split of one transformer block (module name ``base``) to ``plan``.

    Linear layers are grouped by parent module (attention, MLP): the last one registered
    writes back to the residual stream and is row-parallel, the others column-parallel. A
    column layer whose output is k times the row layer's input is k fused blocks (q|k|v). A
    lone linear (e.g. a router) stays replicated. Attributes holding head counts are noted
    for division by the TP size.
    """
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in block.named_modules():
        if _is_linear(module):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            by_parent.setdefault(parent, []).append((name, module))
    prefix = f"{base}." if base else ""
    for parent, linears in by_parent.items():
        if len(linears) < 2:
            continue
        row_name, row = linears[-1]
        plan.styles[prefix + row_name] = "rowwise"
        cols = linears[:-1]
        for name, module in cols:
            plan.styles[prefix + name] = "colwise"
            ratio, rem = divmod(_out_features(module), _in_features(row))
            if len(cols) == 1 and ratio > 1 and rem == 0:
                plan.fused[prefix + name] = ratio
        owner = block.get_submodule(parent) if parent else block
        attrs = [a for a in _HEAD_ATTRS if isinstance(getattr(owner, a, None), int)]
        if attrs:
            plan.head_attrs[prefix + parent if parent else base] = attrs


def _largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    best: tuple[str, nn.ModuleList] | None = None
    best_size = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = (name, module), size
    return best


# ------------------------------------------------------------------------------- apply
def _sharded_region_hooks(model: nn.Module, plan: TPPlan) -> None:
    """Random ops between a block's column-parallel outputs and its row-parallel input use
    the per-TP-rank RNG stream: entered after the first column layer runs, left when the row
    layer starts (per parent module, so attention and MLP regions are separate)."""
    tracker = get_rng_tracker()
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


def _forked_dropout(module: nn.Module) -> None:
    tracker = get_rng_tracker()
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
    p.register_hook(lambda g: _all_reduce(g, group))


def parallelize_tp_(
    model: nn.Module,
    tp_group: comm.Group,
    plan: TPPlan | None = None,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Split ``model``'s layers over ``tp_group`` in place (parameter objects and names kept).

    Args:
        model: a model on its device (not yet sharded by ZeRO; no meta parameters).
        tp_group: the tensor-parallel process group (``mesh.get_group("tp")``).
        plan: which module gets which split; default: :func:`gpt_tp_plan` for
            ``slipstream.models.GPT``, the model's own ``tp_plan()`` if it has one (a
            ``PipelineModule``), else :func:`auto_tp_plan`.
        sequence_parallel: split the residual stream along the sequence between layers
            (reference GPT only; the sequence length must be a multiple of the TP size).

    Every rank must hold the same full weights before the call (same seed, or loaded).
    Returns the model.
    """
    world = comm.get_world_size(tp_group)
    if world == 1:
        return model
    # A meta parameter, or one partitioned by zero.Init (it has DeepSpeed's ds_id).
    meta = [n for n, p in model.named_parameters() if p.is_meta or hasattr(p, "ds_id")]
    if meta:
        raise ConfigError(
            f"tensor parallelism needs full weights on every rank, but {meta[0]!r} is on the "
            "meta device or partitioned (built under zero.Init?): build the model normally; "
            "ZeRO-3 still shards it over the data-parallel ranks after the TP split"
        )
    is_gpt = type(model).__name__ == "GPT" and hasattr(model, "set_tensor_parallel_group")
    own_plan = getattr(model, "tp_plan", None)
    if plan is None and is_gpt:
        plan = gpt_tp_plan(model, sequence_parallel)
    elif plan is None and callable(own_plan):  # e.g. a PipelineModule: its stage's layers
        plan = own_plan()
    elif plan is None:
        plan = auto_tp_plan(model)
    assert plan is not None
    if sequence_parallel and not plan.vocab_parallel_loss:
        raise ConfigError(
            "tensor_parallel.sequence_parallel needs a plan with sequence-parallel norms (the "
            f"reference GPT); {type(model).__name__} uses an automatic plan: set "
            "tensor_parallel.sequence_parallel to false"
        )
    if not get_rng_tracker().has(MODEL_PARALLEL_RNG):
        get_rng_tracker().add(
            MODEL_PARALLEL_RNG, torch.initial_seed() % 2**62 + 2718 + comm.get_rank(tp_group)
        )
    _check_heads(model, plan, world)
    # Every TP rank slices the same full weights: take TP rank 0's.
    src = comm.global_rank(tp_group, 0)
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            comm.broadcast(p.data, src=src, group=tp_group, label="tp_init")
    sp = sequence_parallel
    for name, style in plan.styles.items():
        module = model.get_submodule(name)
        new: nn.Module | None = None
        if style == "colwise":
            new = ColumnParallelLinear.from_module(
                module, tp_group, sequence_parallel=sp, fused_parts=plan.fused.get(name, 1)
            )
        elif style == "colwise_gather":
            new = ColumnParallelLinear.from_module(module, tp_group, gather_output=True)
        elif style == "rowwise":
            new = RowParallelLinear.from_module(module, tp_group, sequence_parallel=sp)
        elif style == "vocab_embed":
            if not isinstance(module, nn.Embedding):
                raise ConfigError(f"TP plan: {name!r} is {type(module).__name__}, not Embedding")
            new = VocabParallelEmbedding.from_module(module, tp_group, sequence_parallel=sp)
        elif style == "sp_norm":
            for p in module.parameters():
                _sum_grad_over(p, tp_group)
        elif style == "sp_dropout":
            _forked_dropout(module)
        else:
            raise ConfigError(f"TP plan: unknown style {style!r} for module {name!r}")
        if new is not None:
            _replace(model, name, new)
    for name, attrs in plan.head_attrs.items():
        owner = model.get_submodule(name)
        for attr in attrs:
            setattr(owner, attr, getattr(owner, attr) // world)
    _sharded_region_hooks(model, plan)
    if plan.vocab_parallel_loss:
        model.set_tensor_parallel_group(tp_group, sequence_parallel=sp)  # type: ignore[operator]
    model.tp_group = tp_group  # type: ignore[assignment]
    return model


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


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def is_tp_sharded(p: torch.Tensor) -> bool:
    """True for a parameter holding one TP rank's slice."""
    return tp_shard(p) is not None


def unshard_tp(
    p: torch.Tensor, group: comm.Group, value: torch.Tensor | None = None
) -> torch.Tensor:
    """The full logical tensor of TP-sharded parameter ``p`` (or of ``value``, a tensor
    sharded like ``p``, e.g. its gradient); replicated tensors are returned as they are.
    Collective over ``group``."""
    value = (p if value is None else value).detach()
    shard = tp_shard(p)
    if shard is None or comm.get_world_size(group) == 1:
        return value
    dim, parts = shard.dim, shard.parts
    world = comm.get_world_size(group)
    full = _all_gather(value, group, dim)  # rank-major: [rank0 blocks..., rank1 ...]
    if parts == 1:
        return full
    pieces = full.chunk(world * parts, dim)  # (rank, block) order -> (block, rank) order
    return torch.cat([pieces[r * parts + b] for b in range(parts) for r in range(world)], dim)
