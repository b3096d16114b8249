"""Tensor-parallel plans: which module of a model gets which split.

A :class:`TPPlan` names modules and their styles. A model states its own plan through a
``tp_plan(sequence_parallel)`` method (slipstream's GPT in ``slipstream.models.gpt_plans``, a
``PipelineModule`` for its stage's layers); :func:`auto_tp_plan` derives one from module
structure for models without it (Hugging Face LLaMA-family, GPT-2 and others built the same
way). ``parallelize_tp_`` applies either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm

__all__ = ["Style", "TPPlan", "add_block_plan", "auto_tp_plan"]

Style = Literal["colwise", "rowwise", "vocab_embed", "colwise_gather", "sp_norm", "sp_dropout"]


@dataclass
class TPPlan:
    """Module name -> style; plus the model-level steps a plan needs.

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
    sequence_parallel: bool = False
    """The plan handles a residual stream split along the sequence ("sp_norm" and
    "sp_dropout" styles), so ``parallelize_tp_(sequence_parallel=True)`` may apply it."""
    after_split: list[Callable[[comm.Group], None]] = field(default_factory=list)
    """Steps run with the TP group once the layers are split: how a model's own plan
    installs the parts whose forward needs the group (the GPT swaps in a
    ``VocabParallelOutput``; a ``PipelineModule`` hands the group to its loss), so the model
    class holds no group itself."""


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
    blocks = largest_module_list(model)
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
    lone linear (e.g. a router) stays replicated, and so do the experts of an MoE layer
    without ``enable_expert_tensor_parallelism``. Attributes holding head counts are noted
    for division by the TP size.
    """
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    replicated = _replicated_experts(block)
    for name, module in block.named_modules():
        if _is_linear(module) and id(module) not in replicated:
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


def _replicated_experts(block: nn.Module) -> set[int]:
    """The modules inside the experts of MoE layers built with
    ``enable_expert_tensor_parallelism=False`` (DeepSpeed's flag): they stay whole on every TP
    rank (``slipstream.moe.tensor_parallel``); the experts of the other layers are split like
    any MLP."""
    out: set[int] = set()
    for module in block.modules():
        if getattr(module, "enable_expert_tensor_parallelism", None) is False:
            experts = getattr(module, "expert_module", None)
            if isinstance(experts, nn.Module):
                out.update(id(m) for m in experts.modules())
    return out


def largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` with the most parameters (a model's transformer blocks), with
    its name; None when the model has none."""
    best: tuple[str, nn.ModuleList] | None = None
    best_size = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = (name, module), size
    return best
