"""MMCA inside language models, and the two decoders VisualChat drives.

* slipstream's reference GPT: each ``Attention.core`` (the seam its parallel plans use) is
  swapped for an :class:`MMCACore`, which reads the batch's token types from a shared
  :class:`TokenTypes` that the caller fills before each forward (the GPT forward signature
  carries token ids only).
* Hugging Face LLaMA-family models: :func:`register_hf_mmca` adds an attention function named
  ``"slipstream_mmca"`` to transformers' ``AttentionInterface``; the model is switched to it
  with ``set_attn_implementation`` and takes ``token_types`` (and ``mmca_mode``) as forward
  keywords, which transformers hands to every attention call, KV cache included.

:class:`GPTDecoder` and :class:`HFDecoder` give both the same small surface: the input
embedding, a forward from embeddings to logits with token types, the context length.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from torch import nn

from slipstream.models.gpt import GPT, Attention
from slipstream.multimodal.attention import MMCAMode, mmca_attention

__all__ = [
    "HF_ATTENTION_NAME",
    "Decoder",
    "ExtendedEmbedding",
    "GPTDecoder",
    "HFDecoder",
    "MMCACore",
    "TokenTypes",
    "make_decoder",
    "register_hf_mmca",
    "use_mmca_",
]

HF_ATTENTION_NAME = "slipstream_mmca"


class TokenTypes:
    """The token types ``[B, L]`` of the batch a GPT with MMCA cores is running; its owner sets
    ``value`` before each forward. It is not cleared afterwards, so activation recomputation
    during backward sees the same types."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class MMCACore(nn.Module):
    """A GPT attention core running :func:`mmca_attention`: ``forward(q, k, v)`` with ``q``
    ``[B, H, T, D]``, ``k``/``v`` ``[B, kv, T, D]``, returns ``[B, T, H, D]`` (as
    ``CausalAttention``)."""

    def __init__(self, types: TokenTypes, mode: MMCAMode, dropout: float = 0.0) -> None:
        super().__init__()
        self.types, self.mode, self.dropout = types, mode, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        types = self.types.value
        if types is None or types.shape != (k.shape[0], k.shape[2]):
            got = None if types is None else tuple(types.shape)
            raise RuntimeError(
                f"MMCACore: token types {got} do not match the keys [B, L] = "
                f"{(k.shape[0], k.shape[2])}; set TokenTypes.value for this batch before the "
                "forward (VisualChat does this for you)"
            )
        p = self.dropout if self.training else 0.0
        return mmca_attention(q, k, v, types, self.mode, dropout_p=p).transpose(1, 2)


def use_mmca_(model: GPT, mode: MMCAMode) -> TokenTypes:
    """Swap every attention core of ``model`` for an :class:`MMCACore` in place; returns the
    :class:`TokenTypes` the cores read."""
    types = TokenTypes()
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = MMCACore(types, mode, model.config.dropout)
    return types


def _hf_mmca(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: MMCA over the ``token_types`` keyword."""
    types = kwargs.get("token_types")
    if types is None or types.shape != (key.shape[0], key.shape[2]):
        got = None if types is None else tuple(types.shape)
        raise ValueError(
            f"{HF_ATTENTION_NAME} attention: pass token_types [B, L] = "
            f"{(key.shape[0], key.shape[2])} covering the cached and new tokens to the model's "
            f"forward; got {got}"
        )
    mode = kwargs.get("mmca_mode", "paper")
    out = mmca_attention(query, key, value, types, mode, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2), None


def register_hf_mmca() -> str:
    """Register MMCA with transformers' ``AttentionInterface`` (idempotent); returns its name
    for ``model.set_attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_mmca)
    return HF_ATTENTION_NAME


class ExtendedEmbedding(nn.Module):
    """A frozen token embedding plus ``num_new`` trainable rows for new special tokens.

    Ids below the base vocabulary read the frozen table, ids ``V .. V + num_new - 1`` the new
    rows. New rows start at the mean of the base rows (a neutral point the model has seen).
    """

    def __init__(self, base: nn.Embedding, num_new: int) -> None:
        super().__init__()
        self.base = base
        self.base_vocab = base.num_embeddings
        mean = base.weight.detach().mean(dim=0, keepdim=True)
        self.new_rows = nn.Parameter(mean.repeat(num_new, 1).clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_new = ids >= self.base_vocab
        out = self.base(ids.clamp(max=self.base_vocab - 1))
        if self.new_rows.shape[0] == 0 or not bool(is_new.any()):
            return out
        new = self.new_rows[(ids - self.base_vocab).clamp(0, self.new_rows.shape[0] - 1)]
        return torch.where(is_new.unsqueeze(-1), new.to(out.dtype), out)


class Decoder(Protocol):
    """What VisualChat needs from a causal LM."""

    hidden_size: int
    vocab_size: int
    context_length: int

    def input_embedding(self) -> nn.Embedding:
        """The LM's token embedding table."""
        ...

    def logits(
        self,
        embeds: torch.Tensor,
        token_types: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``embeds [B, T, d]`` (the last T of ``token_types``)."""
        ...


class GPTDecoder:
    """slipstream's GPT with MMCA cores. The GPT's KV-cache path (``cached_attention`` of
    ``models/gpt_generation.py``) does not run the MMCA cores, so this decoder recomputes the
    context each step and ``cache`` must be None."""

    def __init__(self, model: GPT, mode: MMCAMode) -> None:
        self.model, self.types = model, use_mmca_(model, mode)
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.context_length = model.config.max_seq_len

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def logits(
        self,
        embeds: torch.Tensor,
        token_types: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            raise ValueError(
                "GPTDecoder decodes without a KV cache (the GPT's cached attention does not "
                "run the MMCA cores); recompute the context instead"
            )
        gpt, t = self.model, embeds.shape[1]
        if t > self.context_length:
            raise ValueError(
                f"GPTDecoder: {t} tokens exceed the GPT's max_seq_len={self.context_length}"
            )
        self.types.value = token_types
        # RoPE is relative, so the slot index is as good as the real position here.
        x = gpt.embed_dropout(embeds)
        cos, sin = gpt.rope_cos[:t].to(x.dtype), gpt.rope_sin[:t].to(x.dtype)
        checkpointed = gpt.config.activation_checkpointing and torch.is_grad_enabled()
        for layer in gpt.layers:
            x = (
                gpt.recompute_context.run(layer, x, cos, sin)
                if checkpointed
                else layer(x, cos, sin)
            )
        return gpt.lm_head(gpt.norm(x))  # type: ignore[no-any-return]


class HFDecoder:
    """A transformers causal LM (LLaMA family) switched to the MMCA attention function."""

    def __init__(self, model: nn.Module, mode: MMCAMode) -> None:
        config: Any = model.config
        self.model, self.mode = model, mode
        model.set_attn_implementation(register_hf_mmca())  # type: ignore[operator]
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        # transformers >= 5 names the cache argument ``cache``, earlier ones ``past_key_values``.
        params = inspect.signature(type(model).forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"

    def input_embedding(self) -> nn.Embedding:
        return self.model.get_input_embeddings()  # type: ignore[operator,no-any-return]

    def logits(
        self,
        embeds: torch.Tensor,
        token_types: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any | None = None,
    ) -> torch.Tensor:
        kwargs = {self._cache_argument: cache} if cache is not None else {}
        out = self.model(
            inputs_embeds=embeds, position_ids=position_ids, use_cache=cache is not None,
            token_types=token_types, mmca_mode=self.mode, **kwargs,
        )  # fmt: skip
        return out.logits  # type: ignore[no-any-return]


def make_decoder(lm: nn.Module, mode: MMCAMode) -> GPTDecoder | HFDecoder:
    """The :class:`Decoder` for ``lm``: slipstream's GPT or a transformers causal LM."""
    if isinstance(lm, GPT):
        return GPTDecoder(lm, mode)
    if hasattr(lm, "config") and hasattr(lm, "get_input_embeddings"):
        return HFDecoder(lm, mode)
    raise TypeError(
        f"VisualChat: the language model must be slipstream.models.GPT or a transformers "
        f"causal LM (LlamaForCausalLM, ...); got {type(lm).__name__}"
    )
