"""Compression-aware Linear, Conv2d, Embedding and BatchNorm2d (DeepSpeed's ``basic_layer``).

``make_compressible_(module)`` turns a module into its compression-aware class in place (the
same object, parameters and names; only ``__class__`` changes, as FSDP2's ``fully_shard``
does). The layer then carries the techniques ``init_compression`` enables on it, each behind
its DeepSpeed switch attribute (``weight_quantization_enabled``, ``activation_quantization_
enabled``, ``sparse_pruning_enabled``, ...) that the compression scheduler turns on at the
technique's ``schedule_offset``. Forward order, as DeepSpeed's: quantized weight, sparse mask,
row mask, head mask, quantized input. ``fix_*`` bake a technique into the weights for
``redundancy_clean``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from slipstream.compression.quantizers import (
    asymmetric_quantize,
    quantize_weight,
    symmetric_quantize,
    topk_mask,
)

__all__ = [
    "CompressedBatchNorm2d",
    "CompressedConv2d",
    "CompressedEmbedding",
    "CompressedLinear",
    "QuantAct",
    "is_compressible",
    "make_compressible_",
]

ACT_RANGE_MOMENTUM = 0.95
"""Momentum of the static activation range (DeepSpeed's ``QuantAct`` default)."""


class QuantAct(nn.Module):
    """Static activation range: a running min/max (buffer ``x_min_max``) updated with momentum
    in training and fixed in eval; every forward quantizes with that one range."""

    def __init__(self, quantization_type: str = "symmetric") -> None:
        super().__init__()
        self.act_range_momentum = ACT_RANGE_MOMENTUM
        self.quant_mode = quantization_type
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor, num_bits: int, *unused: Any) -> torch.Tensor:
        rng: torch.Tensor = self.x_min_max  # type: ignore[assignment]
        if self.training:
            lo, hi = x.data.min(), x.data.max()
            if rng[0] == rng[1]:  # first batch: start from its range
                rng[0], rng[1] = lo, hi
            mom = self.act_range_momentum
            rng[0] = rng[0] * mom + lo * (1 - mom)
            rng[1] = rng[1] * mom + hi * (1 - mom)
        quant = symmetric_quantize if self.quant_mode == "symmetric" else asymmetric_quantize
        return quant(x, num_bits, rng[0], rng[1])


def _new_scores(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    scores = nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


def _buffer(module: Any, name: str) -> torch.Tensor:
    buf: torch.Tensor = getattr(module, name)
    return buf


def _keep(module: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    """A new parameter holding ``tensor`` in place of ``module.<name>`` (a pruned shape)."""
    param = nn.Parameter(tensor.contiguous(), requires_grad=getattr(module, name).requires_grad)
    setattr(module, name, param)
    return param


class _Compressible:
    """State and the quantizers shared by the compression-aware layers."""

    @property
    def _w(self) -> nn.Parameter:
        return self.weight  # type: ignore[attr-defined,no-any-return]

    def _init_compression_state(self) -> None:
        self.weight_quantization_enabled = False
        self.weight_quantization_enabled_in_forward = False
        self.activation_quantization_enabled = False
        self.sparse_pruning_enabled = False
        self.row_pruning_enabled = False
        self.head_pruning_enabled = False
        self.channel_pruning_enabled = False
        self.activation_quantization_method: str | None = None
        self.sparse_pruning_method: str | None = None
        self.row_pruning_method: str | None = None
        self.head_pruning_method: str | None = None
        self.channel_pruning_method: str | None = None
        self.weight_bits: int | None = None

    # -------------------------------------------------------------- weight quantization
    def enable_weight_quantization(
        self, target_bits: int, in_forward: bool, quantization_type: str, num_groups: int
    ) -> None:
        """Quantize the weight at ``target_bits`` in every forward once the schedule enables it."""
        self.weight_bits = target_bits
        self.weight_quantization_enabled_in_forward = in_forward
        self.weight_quantization_type = quantization_type
        self.weight_quantize_num_groups = num_groups

    def _quantized_weight(self) -> torch.Tensor:
        assert self.weight_bits is not None
        return quantize_weight(
            self._w,
            self.weight_bits,
            self.weight_quantization_type,
            self.weight_quantize_num_groups,
        )

    def _forward_weight(self) -> torch.Tensor:
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            return self._quantized_weight()
        return self._w

    def fix_weight_quantization(self) -> None:
        """Store the quantized values in the weight and stop quantizing in forward."""
        self._w.data = self._quantized_weight().data
        self.weight_quantization_enabled_in_forward = False

    # ---------------------------------------------------------- activation quantization
    def enable_activation_quantization(
        self, bits: int, quantization_type: str, range_calibration: str
    ) -> None:
        """Quantize this layer's input once the schedule enables it."""
        self.activation_quantization_bits = bits
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        self.activation_quantization_type = quantization_type
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quantization_type)

    def _quantize_input(self, x: torch.Tensor, dynamic_groups: int) -> torch.Tensor:
        bits = self.activation_quantization_bits
        assert self.activation_quantization_method is not None
        if self.activation_quantization_method.endswith("static"):
            return self.activation_quantizer(x, bits)  # type: ignore[no-any-return]
        if self.activation_quantization_type == "symmetric":
            return symmetric_quantize(x, bits, None, None, dynamic_groups)
        return asymmetric_quantize(x, bits, None, None, dynamic_groups)

    # ------------------------------------------------------------------ sparse pruning
    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        """Unstructured mask: l1 fixed now from |w|, topk from learned scores."""
        self.sparse_pruning_ratio = ratio
        self.sparse_pruning_method = method
        mask = None
        if method == "l1":
            mask = topk_mask(self._w.data.abs(), ratio).view(self._w.size())
        else:
            self.sparse_mask_scores = _new_scores(tuple(self._w.size()), self._w)
        self._register("sparse_pruning_mask", mask)

    def _register(self, name: str, mask: torch.Tensor | None) -> None:
        self.register_buffer(name, mask)  # type: ignore[attr-defined]

    def _sparse_mask(self) -> torch.Tensor:
        if self.sparse_pruning_method == "l1":
            return _buffer(self, "sparse_pruning_mask").to(self._w.device)
        return topk_mask(self.sparse_mask_scores, self.sparse_pruning_ratio)

    def fix_sparse_pruning_helper(self) -> None:
        self._w.data = self._w.data * self._sparse_mask()
        delattr(self, "sparse_pruning_mask")
        if self.sparse_pruning_method == "topk":
            delattr(self, "sparse_mask_scores")
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False


class CompressedLinear(_Compressible, nn.Linear):
    """``nn.Linear`` with DeepSpeed's compression techniques (``LinearLayer_Compress``)."""

    def enable_row_pruning(self, ratio: float, method: str) -> None:
        """Mask whole output rows: l1 by row L1 norm now, topk by learned scores."""
        self.row_pruning_ratio = ratio
        self.row_pruning_method = method
        mask = None
        if method == "l1":
            norms = torch.linalg.norm(self.weight.data, ord=1, dim=1)
            mask = topk_mask(norms, ratio).view(-1, 1)
        else:
            self.row_mask_scores = _new_scores((self.weight.size(0), 1), self.weight)
        self._register("row_pruning_mask", mask)

    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        """Mask whole attention heads of this (output-projection) layer's input, by learned
        head scores (topk; DeepSpeed has no other head-pruning method)."""
        self.num_heads = num_heads
        self.head_pruning_ratio = ratio
        self.head_pruning_method = method
        self.head_pruning_scores = _new_scores((1, num_heads), self.weight)

    def _row_mask(self) -> torch.Tensor:
        if self.row_pruning_method == "l1":
            return _buffer(self, "row_pruning_mask").to(self.weight.device)
        return topk_mask(self.row_mask_scores, self.row_pruning_ratio)

    def _head_mask(self) -> torch.Tensor:
        return topk_mask(self.head_pruning_scores, self.head_pruning_ratio)

    def _mask_heads(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out_f, in_f = w.shape
        return (w.t().reshape(self.num_heads, -1) * mask.view(-1, 1)).reshape(in_f, out_f).t()

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False) -> Any:
        weight: torch.Tensor = self._forward_weight()
        bias: torch.Tensor | None = self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self._sparse_mask().view(self.weight.size())
        if self.row_pruning_enabled and self.row_pruning_method:
            mask = self._row_mask()
            weight = weight * mask.view(-1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        if self.head_pruning_enabled and self.head_pruning_method:
            weight = self._mask_heads(weight, self._head_mask())
        if self.activation_quantization_enabled:
            input = self._quantize_input(input, input.numel() // input.size(-1))
        if skip_bias_add:
            return F.linear(input, weight, None), bias
        return F.linear(input, weight, bias)

    def fix_row_col_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Own row mask (``mask`` None): drop the pruned rows (``dim_reduction``) or zero them,
        and return the mask. A related layer's mask: drop the matching input columns."""
        if mask is not None:
            _keep(self, "weight", self.weight.data[:, mask.view(-1)])
            self.in_features = self.weight.size(1)
            self.row_pruning_enabled = False
            return None
        mask = self._row_mask().bool()
        if dim_reduction:
            _keep(self, "weight", self.weight.data[mask.view(-1), :])
            if self.bias is not None:
                _keep(self, "bias", self.bias.data[mask.view(-1)])
            self.out_features = self.weight.size(0)
        else:
            self.weight.data = self.weight.data * mask.view(-1, 1)
            if self.bias is not None:
                self.bias.data = self.bias.data * mask.view(-1)
        del self.row_pruning_mask
        if self.row_pruning_method == "topk":
            del self.row_mask_scores
        self.row_pruning_method = None
        self.row_pruning_enabled = False
        return mask

    def fix_head_pruning_helper(
        self,
        mask: torch.Tensor | None = None,
        num_heads: int | None = None,
        dim_reduction: bool = False,
    ) -> torch.Tensor | None:
        """Own head mask: drop (``dim_reduction``) or zero the pruned heads' input columns and
        return the mask. A related layer (Q, K, V) with the output layer's mask: drop the
        pruned heads' output rows."""
        heads = num_heads or self.num_heads
        if mask is not None:
            in_f = self.weight.size(1)
            keep = mask.view(-1)
            _keep(self, "weight", self.weight.data.reshape(heads, -1)[keep, :].reshape(-1, in_f))
            if self.bias is not None:
                _keep(self, "bias", self.bias.data.reshape(heads, -1)[keep, :].reshape(-1))
            self.out_features = self.weight.size(0)
            self.head_pruning_enabled = False
            return mask
        mask = self._head_mask().bool()
        out_f = self.weight.size(0)
        if dim_reduction:
            kept = self.weight.data.t().reshape(heads, -1)[mask.view(-1), :]
            _keep(self, "weight", kept.reshape(-1, out_f).t())
            self.in_features = self.weight.size(1)
        else:
            self.weight.data = self._mask_heads(self.weight.data, mask)
        del self.head_pruning_scores
        self.head_pruning_method = None
        self.head_pruning_enabled = False
        return mask


class CompressedConv2d(_Compressible, nn.Conv2d):
    """``nn.Conv2d`` with DeepSpeed's compression techniques (``Conv2dLayer_Compress``)."""

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        """Mask whole output channels: l1 by the kernel's L1 norm now, topk by learned scores."""
        self.channel_pruning_ratio = ratio
        self.channel_pruning_method = method
        mask = None
        if method == "l1":
            # The kernel's L1 norm (DeepSpeed's torch.linalg.norm(ord=1) over three dims
            # raises on current PyTorch; vector_norm is the sum of |w| it intends).
            norms = torch.linalg.vector_norm(self.weight.data, ord=1, dim=(1, 2, 3))
            mask = topk_mask(norms, ratio).view(-1, 1, 1, 1)
        else:
            self.channel_mask_scores = _new_scores((self.weight.size(0), 1, 1, 1), self.weight)
        self._register("channel_pruning_mask", mask)

    def enable_weight_quantization(
        self, target_bits: int, in_forward: bool, quantization_type: str, num_groups: int
    ) -> None:
        if in_forward and target_bits < 4:
            raise ValueError(
                f"weight_quantization: target_bits = {target_bits} on a Conv2d; convolution "
                "weights are quantized at 4 bits or more (as DeepSpeed): move this module to "
                "a group with target_bits >= 4"
            )
        super().enable_weight_quantization(target_bits, in_forward, quantization_type, num_groups)

    def _channel_mask(self) -> torch.Tensor:
        if self.channel_pruning_method == "l1":
            return _buffer(self, "channel_pruning_mask").to(self.weight.device)
        return topk_mask(self.channel_mask_scores, self.channel_pruning_ratio)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self._forward_weight()
        bias: torch.Tensor | None = self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self._sparse_mask().view(self.weight.size())
        if self.channel_pruning_enabled:
            mask = self._channel_mask()
            weight = weight * mask.view(-1, 1, 1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        if self.activation_quantization_enabled:
            input = self._quantize_input(input, input.numel() // input[0].numel())
        return self._conv_forward(input, weight, bias)

    def fix_channel_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Own channel mask: drop (``dim_reduction``) or zero the pruned output channels and
        return the mask; a related layer's mask: drop the matching input channels."""
        if mask is not None:
            _keep(self, "weight", self.weight.data[:, mask.view(-1), ...])
            self.in_channels = self.weight.size(1)
            self.channel_pruning_enabled = False
            return None
        mask = self._channel_mask().bool()
        if dim_reduction:
            _keep(self, "weight", self.weight.data[mask.view(-1), ...])
            if self.bias is not None:
                _keep(self, "bias", self.bias.data[mask.view(-1)])
            self.out_channels = self.weight.size(0)
        else:
            self.weight.data = self.weight.data * mask.view(-1, 1, 1, 1)
            if self.bias is not None:
                self.bias.data = self.bias.data * mask.view(-1)
        del self.channel_pruning_mask
        if self.channel_pruning_method == "topk":
            del self.channel_mask_scores
        self.channel_pruning_method = None
        self.channel_pruning_enabled = False
        return mask


class CompressedEmbedding(_Compressible, nn.Embedding):
    """``nn.Embedding`` with weight quantization, one range per row (``Embedding_Compress``)."""

    def enable_weight_quantization(
        self, target_bits: int, in_forward: bool, quantization_type: str, num_groups: int
    ) -> None:
        super().enable_weight_quantization(
            target_bits, in_forward, quantization_type, self.weight.size(0)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(
            input,
            self._forward_weight(),
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )


class CompressedBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that follows a pruned Conv2d's channels (``BNLayer_Compress``)."""

    def _init_compression_state(self) -> None:
        pass

    def fix_channel_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = True
    ) -> None:
        assert mask is not None
        keep = mask.view(-1)
        _keep(self, "weight", self.weight.data[keep])
        _keep(self, "bias", self.bias.data[keep])
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean = self.running_mean[keep]
        self.running_var = self.running_var[keep]
        self.num_features = self.weight.numel()


_CLASSES: tuple[tuple[type[nn.Module], type[nn.Module]], ...] = (
    (nn.Linear, CompressedLinear),
    (nn.Conv2d, CompressedConv2d),
    (nn.Embedding, CompressedEmbedding),
    (nn.BatchNorm2d, CompressedBatchNorm2d),
)


def is_compressible(module: nn.Module) -> bool:
    """Linear, Conv2d, Embedding and BatchNorm2d (and subclasses), as DeepSpeed selects."""
    return isinstance(module, tuple(base for base, _ in _CLASSES))


def make_compressible_(module: nn.Module) -> nn.Module:
    """Give ``module`` its compression-aware class in place (idempotent); returns it.

    Raises:
        TypeError: ``module`` is not a Linear, Conv2d, Embedding or BatchNorm2d.
    """
    for base, compressed in _CLASSES:
        if isinstance(module, compressed):
            return module
        if isinstance(module, base):
            module.__class__ = compressed
            module._init_compression_state()  # type: ignore[operator]
            return module
    raise TypeError(
        f"make_compressible_: {type(module).__name__} is not a Linear, Conv2d, Embedding or "
        "BatchNorm2d module"
    )
