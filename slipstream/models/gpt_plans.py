"""The parallelism plans of slipstream's GPT (``slipstream.models.gpt``), applied from outside.

The GPT is a single-device model: it holds no process group and does not know it is split.
It exposes three replaceable parts (each layer's attention core ``layers.{i}.attn.core``, the
sequence ``positions`` and the ``output`` step that turns logits into the loss) and names its
plans through two methods that return the objects defined here:

- ``GPT.tp_plan(sequence_parallel)`` -> :func:`gpt_tp_plan`: Megatron's split of attention
  and SwiGLU MLP, a vocabulary-parallel embedding and LM head, and a
  :class:`~slipstream.parallel.tensor.VocabParallelOutput` swapped in for ``output`` once the
  group is known; with ``sequence_parallel`` also the sequence-split norms and dropout.
- ``GPT.sp_plan(sp_group)`` -> :func:`gpt_sp_plan`: Ulysses or LSS attention cores, sharded
  positions (RoPE offsets) and the global-mean loss.

``slipstream.parallel.tensor.parallelize_tp_`` and ``slipstream.sequence.parallelize_sequence_``
apply them. This module addresses the GPT by its stable module names, so it does not import
the model class.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.parallel.tensor import TPPlan, VocabParallelOutput, replace_module_
from slipstream.sequence import (
    SequenceParallelAttention,
    SequenceParallelOutput,
    ShardedSequence,
    SPPlan,
    ZigZagSequence,
)
from slipstream.zero.param import full_shape

__all__ = ["gpt_sp_plan", "gpt_tp_plan"]

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def gpt_tp_plan(model: nn.Module, sequence_parallel: bool = False) -> TPPlan:
    """The tensor-parallel plan of a ``GPT``: Megatron's split of attention and SwiGLU MLP,
    a vocab-parallel embedding and LM head with the vocab-parallel loss.

    Raises:
        ConfigError: ``sequence_parallel`` on a GPT that already runs Ulysses/LSS sequence
            parallelism (the two split the sequence differently).
    """
    if sequence_parallel and isinstance(model.get_submodule("positions"), ShardedSequence):
        raise ConfigError(
            "Megatron-style sequence parallelism (tensor_parallel.sequence_parallel) and "
            "Ulysses/LSS sequence parallelism cannot be combined on one GPT: choose one"
        )
    plan = TPPlan(sequence_parallel=sequence_parallel)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLWISE:
            plan.styles[name] = "colwise"
        elif leaf in _ROWWISE:
            plan.styles[name] = "rowwise"
        elif name == "embed_tokens":
            plan.styles[name] = "vocab_embed"
        elif name == "lm_head":
            plan.styles[name] = "colwise"
        elif sequence_parallel and leaf in ("attn_norm", "mlp_norm", "norm"):
            plan.styles[name] = "sp_norm"
        elif sequence_parallel and isinstance(module, nn.Dropout):
            plan.styles[name] = "sp_dropout"

    def vocab_parallel_output(tp_group: comm.Group) -> None:
        # The LM head now yields this rank's slice of the vocabulary.
        replace_module_(model, "output", VocabParallelOutput(tp_group))

    plan.after_split.append(vocab_parallel_output)
    return plan


def gpt_sp_plan(
    model: nn.Module, sp_group: comm.Group, method: str | None, dropout: float
) -> SPPlan:
    """The sequence-parallel plan of a ``GPT`` built with ``sequence_parallel=method``.

    Inputs then are this rank's sequence segment: every attention core attends over the whole
    sharded sequence, RoPE positions are offset by the segment's start and the loss is the
    global mean. ``dropout``: the attention-probability dropout of the config.

    Raises:
        ConfigError: the GPT was built without sequence-parallel attention and the group has
            more than one rank.
    """
    if method is None and comm.get_world_size(sp_group) > 1:
        raise ConfigError(
            "this GPT was built with GPTConfig.sequence_parallel=None: set it to "
            "'ulysses' or 'lss' to train with sequence parallelism"
        )
    kind: Literal["ulysses", "lss", "ring"] = (
        "lss" if method == "lss" else "ring" if method == "ring" else "ulysses"
    )
    plan = SPPlan()
    for name, _ in model.named_modules():
        if name.endswith(".attn.core"):
            if kind == "ulysses":
                _check_local_heads(model, name.removesuffix(".core"), comm.get_world_size(sp_group))
            plan.replace[name] = SequenceParallelAttention(kind, sp_group, dropout)
    positions = ZigZagSequence if kind == "ring" else ShardedSequence
    plan.replace["positions"] = positions(sp_group)
    # After tensor parallelism the output is vocabulary-parallel: it stays, inside the mean.
    local = model.get_submodule("output")
    inner = local if isinstance(local, VocabParallelOutput) else None
    plan.replace["output"] = SequenceParallelOutput(sp_group, inner)
    return plan


def _check_local_heads(model: nn.Module, attn_name: str, sp: int) -> None:
    """Ulysses splits this rank's heads (all of them, or ``num_heads / tp`` after tensor
    parallelism; read from the q/k projections' rows) over the ``sp`` ranks."""
    attn = model.get_submodule(attn_name)
    head_dim, total = getattr(attn, "head_dim", None), getattr(attn, "num_heads", None)
    if not isinstance(head_dim, int):  # not the GPT's attention: checked at run time
        return
    try:
        heads = full_shape(attn.get_parameter("q_proj.weight"))[0] // head_dim
        kv = full_shape(attn.get_parameter("k_proj.weight"))[0] // head_dim
    except AttributeError:  # a wrapped projection: ulysses_attention checks at run time
        return
    if heads % sp == 0 and (kv % sp == 0 or sp % kv == 0):
        return
    split = "" if heads == total else f" (of {total}; tensor parallelism)"
    raise ConfigError(
        f"sequence_parallel_size={sp}: {attn_name} holds {heads} query heads{split} and {kv} "
        f"KV heads on this rank; Ulysses needs the query heads to divide by {sp} and the KV "
        f"heads to divide by or divide {sp}. Use ring attention (GPTConfig(sequence_parallel="
        "'ring') with \"sequence_parallel_mode\": \"ring\") or LSS ('lss'), which take any head "
        "count, or sizes that split the heads"
    )
