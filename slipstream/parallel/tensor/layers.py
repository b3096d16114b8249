"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, sec. 3): column- and row-parallel
linear layers and the vocabulary-parallel embedding, each built from an existing module whose
parameters it shards in place.

- column-parallel linear (q/k/v, gate/up): weight rows split, the input is replicated, the
  output is this rank's slice of the features;
- row-parallel linear (o_proj, down_proj): weight columns split, the input is the column
  layer's slice, the partial outputs are summed;
- vocab-parallel embedding: rows of the table split by token id, lookups outside this rank's
  range give zero, partial results summed.

Under sequence parallelism the input of a column layer is all-gathered along the sequence and
the output of a row layer (and of the embedding) reduce-scattered along it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.parallel.tensor.collectives import (
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
)
from slipstream.parallel.tensor.params import shard_param_

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


class _TPModule(nn.Module):
    group: comm.Group

    @property
    def tp_size(self) -> int:
        return comm.get_world_size(self.group)

    @property
    def tp_rank(self) -> int:
        return comm.get_rank(self.group)


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
        if not getattr(weight, "_tp_sharded", False):  # a tied weight is split (checked) once
            _check_divisible(module, "output features", weight.shape[out_dim], group, fused_parts)
            shard_param_(weight, out_dim, group, fused_parts)
            weight._tp_sharded = True  # type: ignore[attr-defined]
        bias = getattr(module, "bias", None)
        if bias is not None:
            shard_param_(bias, 0, group, fused_parts)
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
        shard_param_(weight, in_dim, group)
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
            shard_param_(weight, 0, group)
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
