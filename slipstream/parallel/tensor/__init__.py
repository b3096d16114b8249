"""Tensor parallelism (Megatron-style), applied in place: ``parallelize_tp_(model, tp_group)``.

Each transformer layer's matrices are split across the ``tp`` ranks of a group so that a
layer needs two all-reduces in forward and two in backward: column-parallel linear layers
(q/k/v, gate/up; ``f``: identity forward, all-reduce backward), row-parallel ones (o_proj,
down_proj; ``g``: all-reduce forward, identity backward), a vocabulary-parallel embedding and
an LM head column-parallel over the vocabulary whose loss, :func:`vocab_parallel_cross_entropy`,
never builds a full [tokens, vocab] tensor.

With ``sequence_parallel=True`` (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", sec. 4.2.2), the residual stream between layers is split along
the sequence: norms and dropout run on 1/tp of the tokens, the all-reduces become a
reduce-scatter (after row-parallel layers and the embedding) and an all-gather (before
column-parallel layers) of the same volume, and the norm weights' gradients are summed over
the group.

One job per module:

- ``collectives``: the collectives as autograd functions (``copy_to_tp``, ``gather_seq``, ...);
- ``params``: a parameter's TP slice and the full tensor back (``unshard_tp``);
- ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``;
- ``loss``: the vocabulary-parallel cross-entropy and the output module that uses it;
- ``plan``: ``TPPlan`` and the automatic plan for models without their own;
- ``apply``: ``parallelize_tp_``, which applies a plan.

A model states its own plan with a ``tp_plan(sequence_parallel)`` method (slipstream's GPT:
``slipstream.models.gpt_plans``); parameters keep their names and their ``nn.Parameter``
objects (their data becomes the local shard), so optimizers built earlier,
``named_parameters`` and checkpoints keep working.
"""

from slipstream.parallel.tensor.apply import parallelize_tp_, replace_module_
from slipstream.parallel.tensor.collectives import (
    SEQ_DIM,
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
)
from slipstream.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from slipstream.parallel.tensor.loss import VocabParallelOutput, vocab_parallel_cross_entropy
from slipstream.parallel.tensor.params import (
    is_tp_sharded,
    shard_param_,
    tp_join,
    tp_slice,
    unshard_tp,
)
from slipstream.parallel.tensor.plan import Style, TPPlan, add_block_plan, auto_tp_plan

__all__ = [
    "SEQ_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Style",
    "TPPlan",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "add_block_plan",
    "auto_tp_plan",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "is_tp_sharded",
    "parallelize_tp_",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "replace_module_",
    "shard_param_",
    "tp_join",
    "tp_slice",
    "unshard_tp",
    "vocab_parallel_cross_entropy",
]
