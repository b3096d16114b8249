"""Fused, pre-packed projections for the paged forward of LLaMA-family models on the CPU.

A decode step at a batch of a few dozen rows is GEMM-bound on the CPU (docs/inference.md
has the roofline of this project's machine): per layer the LLaMA block runs seven products
of ``[tokens, hidden]`` rows against weights that are read in full every step. This module
turns them into four, each against a weight prepared once:

* ``q_proj``, ``k_proj``, ``v_proj`` become one product against their concatenated weight
  (biases concatenated too, Qwen2's included), split into queries, keys and values after;
* ``gate_proj`` and ``up_proj`` become one product against their concatenated weight, split
  into the two halves before ``act_fn(gate) * up``;
* ``o_proj`` and ``down_proj`` keep their shapes, and so does the LM head when it is a
  plain ``nn.Linear`` (``init_inference`` may already have swapped it to
  ``kernels.PackedHeadLinear``, which is then used as it is).

Each weight is stored in oneDNN's packed GEMM layout (``torch.ops.mkldnn``): on this
project's CPU, a ``[16, 576] x [576, 960]`` product runs in 0.11 ms packed against 0.31 ms
with ``F.linear`` on the module's ``[out, in]`` weight (one thread; ``benchmarks/roofline.py``
measures every product of the model both ways).

The packed weights are copies (one more fp32 copy of every projection: the model's size
again, less the embeddings) owned by :class:`FusedLlama`, built when the paged engine is
built and rebuilt when any source weight changes (storage or in-place version), so a
training step between two generations never serves stale weights. Only fp32 models on
the CPU whose projections are plain ``nn.Linear`` (not quantized, LoRA-wrapped or
swapped by ``kernels.py``) are packed; everything else runs the modules as they are.

Tokens: packed and unpacked products sum in different orders, so hidden states differ by
fp32 rounding (measured below 1e-4 in the logits of the test models); greedy tokens equal
the module forward's except where two logits tie within that rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.inference.kernels import onednn_linear, onednn_linear_available, onednn_pack

__all__ = ["FusedLlama", "fuse_llama"]

Product = Callable[[torch.Tensor], torch.Tensor]


def _packed_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """``x -> F.linear(x, weight, bias)`` on a oneDNN-packed copy of ``weight``."""
    packed = onednn_pack(weight.contiguous(), 16)
    if packed is None:  # oneDNN refused this weight: the plain product on the fused copy
        return lambda x: F.linear(x, weight, bias)
    return lambda x: onednn_linear(x, packed, bias)


def _cat(modules: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in modules])
    if all(m.bias is None for m in modules):
        return weight, None
    biases = [
        m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
        for m in modules
    ]
    return weight, torch.cat(biases)


@dataclass
class _Layer:
    qkv: Product
    split: tuple[int, int, int]
    o: Product
    gate_up: Product
    intermediate: int
    down: Product
    act: Callable[[torch.Tensor], torch.Tensor]


def _linears(layer: Any) -> tuple[nn.Linear, ...] | None:
    attn, mlp = layer.self_attn, layer.mlp
    names = ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
             (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"))  # fmt: skip
    found = tuple(getattr(owner, name, None) for owner, name in names)
    if not hasattr(mlp, "act_fn") or any(type(m) is not nn.Linear for m in found):
        return None
    return found  # type: ignore[return-value]


def _key(linears: list[tuple[nn.Linear, ...]]) -> tuple[Any, ...]:
    return tuple(
        (p.data_ptr(), p._version)
        for group in linears
        for m in group
        for p in (m.weight, m.bias)
        if p is not None
    )


class FusedLlama:
    """The packed, fused projections of every layer of one LLaMA-family model."""

    def __init__(self, layers: list[Any], head: nn.Linear | None) -> None:
        self._modules = layers
        self._linears = [_linears(layer) for layer in layers]
        self._head = head
        self._key: tuple[Any, ...] | None = None
        self.layers: list[_Layer] = []
        self.head: Product | None = None

    def refresh(self) -> None:
        """(Re)build the packed weights if any source weight changed since the last build."""
        linears = [group for group in self._linears if group is not None]
        head = () if self._head is None else ((self._head,),)
        key = _key([*linears, *head])
        if key == self._key:
            return
        self.layers = []
        with torch.no_grad():
            if self._head is not None:
                self.head = _packed_product(*_cat((self._head,)))
            for layer, group in zip(self._modules, linears, strict=True):
                q, k, v, o, gate, up, down = group
                self.layers.append(_Layer(
                    _packed_product(*_cat((q, k, v))),
                    (q.out_features, k.out_features, v.out_features),
                    _packed_product(*_cat((o,))),
                    _packed_product(*_cat((gate, up))),
                    gate.out_features,
                    _packed_product(*_cat((down,))),
                    layer.mlp.act_fn,
                ))  # fmt: skip
        self._key = key

    def attention_inputs(
        self, i: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[tokens, out]`` of layer ``i`` from one product."""
        layer = self.layers[i]
        q, k, v = layer.qkv(h).split(layer.split, dim=-1)
        return q, k, v

    def attention_output(self, i: int, y: torch.Tensor) -> torch.Tensor:
        return self.layers[i].o(y)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(h)) * up(h))`` with gate and up in one product."""
        layer = self.layers[i]
        gate, up = layer.gate_up(h).split(layer.intermediate, dim=-1)
        return layer.down(layer.act(gate) * up)


def fuse_llama(model: nn.Module) -> FusedLlama | None:
    """The fused, packed projections of a LLaMA-family model, or None where they do not
    apply (not fp32 on the CPU, no oneDNN in this torch, a projection that is not a plain
    ``nn.Linear``)."""
    body: Any = getattr(model, "model", None)
    layers = list(getattr(body, "layers", ()))
    if not layers or not onednn_linear_available():
        return None
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if any(_linears(layer) is None for layer in layers):
        return None
    head: Any = model.get_submodule("lm_head") if hasattr(model, "lm_head") else None
    fused = FusedLlama(layers, head if type(head) is nn.Linear else None)
    fused.refresh()
    return fused
