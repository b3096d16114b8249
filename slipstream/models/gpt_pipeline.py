"""The reference GPT (``slipstream.models.gpt``) as a pipeline layer list.

``gpt_pipeline_layers(config)`` returns ``[embedding, block x L, final norm, head]`` as
``LayerSpec``s (the head a ``TiedLayerSpec`` sharing the embedding when
``config.tie_embeddings``). Layer ``i``'s parameters are named like the ``GPT``'s, so
:func:`gpt_parameter_name` maps ``"3.attn.q_proj.weight"`` to ``"layers.2.attn.q_proj.weight"``
and :func:`load_gpt_weights_` copies a ``GPT`` state dict into the layers a stage holds.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.models.gpt import Block, GPTConfig, RMSNorm
from slipstream.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from slipstream.parallel.tensor import (
    VocabParallelEmbedding,
    copy_to_tp,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "GPTBlockLayer",
    "GPTEmbeddingLayer",
    "GPTHeadLayer",
    "GPTNormLayer",
    "gpt_loss",
    "gpt_parameter_name",
    "gpt_pipeline_layers",
    "load_gpt_weights_",
    "tied_lm_head",
]


class GPTEmbeddingLayer(nn.Embedding):
    """Token embedding: int64 ids [B, T] -> hidden states [B, T, H]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def tp_styles(self, vocab_parallel_loss: bool) -> dict[str, str]:
        """Tensor parallel: rows (token ids) split over the TP ranks."""
        return {"": "vocab_embed"}


class GPTBlockLayer(Block):
    """A ``Block`` that owns its RoPE tables, so it takes and returns hidden states only."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        std = 0.02
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                scale = (
                    math.sqrt(2 * config.num_layers)
                    if name.endswith(("o_proj", "down_proj"))
                    else 1.0
                )
                nn.init.normal_(mod.weight, mean=0.0, std=std / scale)
        inv = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def tp_styles(self, vocab_parallel_loss: bool) -> dict[str, str]:
        """Tensor parallel: Megatron's split, as ``gpt_tp_plan`` does for the ``GPT``."""
        styles = {f"attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
        styles.update({"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise"})
        styles.update({"attn.o_proj": "rowwise", "mlp.down_proj": "rowwise"})
        return styles

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t = x.shape[1]
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        return super().forward(x, cos, sin)


class GPTNormLayer(RMSNorm):
    """The final RMSNorm."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.hidden_size, config.norm_eps)


class GPTHeadLayer(nn.Linear):
    """Untied output projection to the vocabulary (logits)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def tp_styles(self, vocab_parallel_loss: bool) -> dict[str, str]:
        """Tensor parallel: split by vocabulary rows; logits stay sharded for a
        vocabulary-parallel loss, else they are gathered."""
        return {"": "colwise" if vocab_parallel_loss else "colwise_gather"}


def tied_lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits through the (tied) embedding matrix: ``x @ E^T``; under tensor parallelism
    (a ``VocabParallelEmbedding``) this rank's vocabulary slice of them."""
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)
    if isinstance(embedding, VocabParallelEmbedding):
        x = copy_to_tp(x, embedding.group)
    return F.linear(x, weight)


def gpt_loss(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: comm.Group = None
) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (the ``GPT`` loss; -100 is ignored).

    With ``tp_group`` the logits are this rank's vocabulary slice and the loss is computed
    without gathering them (:func:`vocab_parallel_cross_entropy`).
    """
    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits.float(), labels, tp_group)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


gpt_loss.vocab_parallel = True  # type: ignore[attr-defined]  # takes tp_group= (PipelineModule)


def gpt_pipeline_layers(config: GPTConfig) -> list[LayerSpec]:
    """``[embedding, blocks..., norm, head]`` for ``PipelineModule(layers=..., loss_fn=gpt_loss)``.

    Tensor parallelism splits these layers like the ``GPT`` (``tp_styles``); dropout and
    sequence parallelism of the ``GPT`` are not carried over.

    Raises:
        ConfigError: ``config.moe`` is set (the layers would place no experts, or drop their
            auxiliary losses from the pipeline's loss).
    """
    if config.moe is not None:
        raise ConfigError(
            f"GPTConfig.moe = {config.moe!r} with gpt_pipeline_layers is not supported: the "
            "pipeline's loss does not carry the MoE layers' auxiliary losses; train the GPT "
            "with experts without pipeline parallelism, or set moe=None"
        )
    if config.tie_embeddings:
        first: LayerSpec = TiedLayerSpec("embed", GPTEmbeddingLayer, config)
        head: LayerSpec = TiedLayerSpec("embed", GPTEmbeddingLayer, config, forward_fn=tied_lm_head)
    else:
        first, head = LayerSpec(GPTEmbeddingLayer, config), LayerSpec(GPTHeadLayer, config)
    blocks = [LayerSpec(GPTBlockLayer, config) for _ in range(config.num_layers)]
    return [first, *blocks, LayerSpec(GPTNormLayer, config), head]


def gpt_parameter_name(name: str, num_layers: int) -> str:
    """The ``GPT`` parameter a pipeline parameter name corresponds to."""
    if name.startswith("tied_modules.embed."):
        return "embed_tokens." + name.split(".", 2)[2]
    idx, rest = name.split(".", 1)
    i = int(idx)
    if i == 0:
        return "embed_tokens." + rest
    if i <= num_layers:
        return f"layers.{i - 1}.{rest}"
    return ("norm." if i == num_layers + 1 else "lm_head.") + rest


@torch.no_grad()
def load_gpt_weights_(module: PipelineModule, state: dict[str, Any], num_layers: int) -> None:
    """Copy a ``GPT`` state dict into the layers this stage holds (every copy of a tied
    weight gets the same values)."""
    for name, p in module.named_parameters():
        p.copy_(state[gpt_parameter_name(name, num_layers)])
