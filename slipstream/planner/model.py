"""The shape of a decoder-only transformer, as much as the planner needs: parameter counts and
FLOPs per layer.

Two families are covered by one description:

- the GPT of Megatron-LM papers (Shoeybi et al. 2019; Narayanan et al. 2021, sec. 5.1):
  LayerNorm with bias, learned position embeddings, a 4h GELU MLP, biases everywhere, the
  output layer tied to the embedding; per layer ``12 h^2 + 13 h`` parameters;
- slipstream's reference GPT (LLaMA-style, ``slipstream.models.gpt``): RMSNorm, RoPE,
  grouped-query attention, a SwiGLU MLP, no biases, an untied ``lm_head``.

:func:`megatron_gpt` builds the first, :func:`from_gpt_config` the second, :func:`from_hf_config`
reads a Hugging Face config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PRESETS",
    "ModelSpec",
    "from_gpt_config",
    "from_hf_config",
    "megatron_gpt",
    "model_preset",
]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. Validated at construction."""

    layers: int
    """Transformer blocks ``l``."""
    hidden: int
    """Residual width ``h``."""
    heads: int
    """Query heads ``a``."""
    vocab: int
    """Vocabulary size ``V`` (padded as the embedding is allocated)."""
    seq: int
    """Training sequence length ``s``."""
    ffn_hidden: int = 0
    """MLP inner width; 0 means ``4 h`` (GELU MLP)."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``heads``."""
    gated_mlp: bool = False
    """SwiGLU (three matrices) instead of a two-matrix MLP."""
    bias: bool = True
    """Linear layers and norms carry biases (Megatron GPT) or not (LLaMA-style)."""
    learned_positions: bool = True
    """A learned ``s x h`` position embedding (GPT) instead of RoPE (no parameters)."""
    tie_embeddings: bool = True
    """The output layer reuses the input embedding matrix."""
    dropout: bool = True
    """Dropout on attention probabilities and residual branches (its masks are stored)."""
    flash_attention: bool = False
    """Attention never materializes the ``a x s x s`` scores (FlashAttention / SDPA): no
    ``5 a s / h`` activation term and no softmax memory traffic. False for the Megatron
    papers of 2021-2022, True for slipstream's reference GPT (``F.scaled_dot_product_attention``)."""
    hf_llama_activations: bool = False
    """Activations are kept as Hugging Face's Llama and slipstream's reference GPT keep them
    in eager PyTorch: RMSNorm computed in fp32 keeps its fp32 input and the normalized value
    besides its output, K and V are repeated to every query head before SDPA (which keeps
    the repeated ones), and SDPA's output is kept besides the contiguous copy the output
    projection reads. False: Megatron's fused kernels (Korthikanti et al. 2022's count)."""
    name: str = field(default="", compare=False)
    """Label used in reports."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, key) < 1:
                raise ValueError(f"ModelSpec.{key} = {getattr(self, key)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"ModelSpec.hidden = {self.hidden} is not divisible by heads = {self.heads}; "
                "choose a hidden size that is a multiple of the head count"
            )
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(
                f"ModelSpec.kv_heads = {self.kv_heads} must divide heads = {self.heads}"
            )

    @property
    def ffn(self) -> int:
        """MLP inner width (``4 h`` unless given)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matmul_params_per_layer(self) -> int:
        """Weights of one block's matrix multiplications: ``12 h^2`` for the Megatron GPT.

        q and o are ``h x h``; k and v are ``h x (kv * head_dim)``; the MLP has 2 (or 3 when
        gated) ``h x ffn`` matrices.
        """
        h, kv_dim = self.hidden, self.kv * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return 2 * h * h + 2 * h * kv_dim + mlp

    def params_per_layer(self) -> int:
        """All parameters of one block: ``12 h^2 + 13 h`` for the Megatron GPT (the weights,
        biases ``3h`` (qkv) + ``h`` (o) + ``4h + h`` (MLP), and two LayerNorms ``4h``)."""
        h, kv_dim = self.hidden, self.kv * self.head_dim
        norms = 2 * (2 * h if self.bias else h)
        if not self.bias:
            return self.matmul_params_per_layer() + norms
        mlp_bias = (2 if self.gated_mlp else 1) * self.ffn + h
        attn_bias = h + 2 * kv_dim + h
        return self.matmul_params_per_layer() + norms + mlp_bias + attn_bias

    def embedding_params(self) -> int:
        """Input embedding (plus learned positions)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """Final norm plus the output layer when it is not tied to the embedding."""
        norm = 2 * self.hidden if self.bias else self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        """Total parameters ``P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))`` (+ final
        LayerNorm) for the Megatron GPT (Narayanan et al. 2021, eq. in sec. 5.1)."""
        return self.layers * self.params_per_layer() + self.embedding_params() + self.head_params()

    def forward_flops_per_layer(self, micro_batch: int) -> float:
        """Forward FLOPs of one block for ``micro_batch`` sequences: ``2 B s W + 4 B s^2 h``.

        ``W`` is :meth:`matmul_params_per_layer` (a multiply-add per weight per token) and
        ``4 B s^2 h`` is ``Q K^T`` plus ``softmax(.) V`` over the full (unmasked) square, the
        convention of Narayanan et al. 2021 (appendix), which gives ``24 B s h^2 + 4 B s^2 h``.
        """
        b, s = micro_batch, self.seq
        return 2.0 * b * s * self.matmul_params_per_layer() + 4.0 * b * s * s * self.hidden

    def attention_core_flops_per_layer(self, micro_batch: int) -> float:
        """Forward FLOPs of ``Q K^T`` and ``softmax(.) V``: what selective recompute redoes
        (Korthikanti et al. 2022, sec. 5)."""
        return 4.0 * micro_batch * self.seq * self.seq * self.hidden

    def logits_forward_flops(self, micro_batch: int) -> float:
        """Forward FLOPs of the output layer ``2 B s h V``."""
        return 2.0 * micro_batch * self.seq * self.hidden * self.vocab


def megatron_gpt(
    layers: int, hidden: int, heads: int, *, vocab: int = 51200, seq: int = 2048, name: str = ""
) -> ModelSpec:
    """The GPT of the Megatron-LM papers (4h GELU MLP, biases, learned positions, tied output)."""
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, name=name)


# Configurations of the papers the planner is validated on (docs/planner.md).
PRESETS: dict[str, dict[str, int]] = {
    # Korthikanti et al. 2022, Table 3 (also Calculon's validation models).
    "megatron-22b": dict(layers=48, hidden=6144, heads=64),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96),
    "mt-nlg-530b": dict(layers=105, hidden=20480, heads=128),
    "megatron-1t": dict(layers=128, hidden=25600, heads=160),
    # Dash et al. 2023 (Frontier): ORNL's launch scripts (specs/parallelism.md sec. 4.3).
    "frontier-22b": dict(layers=48, hidden=6144, heads=96),
    "frontier-175b": dict(layers=96, hidden=12288, heads=96),
    "frontier-1t": dict(layers=128, hidden=25600, heads=128),
}


def model_preset(name: str, **overrides: int) -> ModelSpec:
    """A Megatron GPT from :data:`PRESETS` (vocabulary 51200, sequence 2048 unless overridden)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    kwargs: dict[str, int] = {**PRESETS[name], **overrides}
    return megatron_gpt(name=name, **kwargs)


def from_gpt_config(config: Any, *, seq: int | None = None) -> ModelSpec:
    """The spec of slipstream's reference GPT (:class:`slipstream.models.gpt.GPTConfig`).

    ``seq`` defaults to ``config.max_seq_len``.
    """
    return ModelSpec(
        layers=config.num_layers,
        hidden=config.hidden_size,
        heads=config.num_heads,
        vocab=config.vocab_size,
        seq=seq or config.max_seq_len,
        ffn_hidden=config.intermediate_size,
        kv_heads=config.num_kv_heads,
        gated_mlp=True,
        bias=False,
        learned_positions=False,
        tie_embeddings=config.tie_embeddings,
        dropout=config.dropout > 0,
        flash_attention=True,
        hf_llama_activations=True,
        name="slipstream-gpt",
    )


def from_hf_config(config: Mapping[str, Any] | Any, *, seq: int | None = None) -> ModelSpec:
    """The spec of a Hugging Face decoder config (LLaMA family or GPT-2), dict or object.

    Reads ``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
    ``num_attention_heads``/``n_head``, ``vocab_size``, ``intermediate_size``/``n_inner``,
    ``num_key_value_heads`` and ``max_position_embeddings``/``n_positions`` (or ``seq``).
    """

    def get(key: str, default: Any = None) -> Any:
        if isinstance(config, Mapping):
            return config.get(key, default)
        return getattr(config, key, default)

    llama_like = get("intermediate_size") is not None and get("n_embd") is None
    layers = get("num_hidden_layers") or get("n_layer")
    hidden = get("hidden_size") or get("n_embd")
    heads = get("num_attention_heads") or get("n_head")
    length = seq or get("max_position_embeddings") or get("n_positions")
    missing = [k for k, v in dict(layers=layers, hidden=hidden, heads=heads, seq=length).items()
               if not v]  # fmt: skip
    if missing:
        raise ValueError(f"Hugging Face config lacks {missing}; pass them explicitly")
    return ModelSpec(
        layers=int(layers),
        hidden=int(hidden),
        heads=int(heads),
        vocab=int(get("vocab_size")),
        seq=int(length),
        ffn_hidden=int(get("intermediate_size") or get("n_inner") or 0),
        kv_heads=int(get("num_key_value_heads") or 0),
        gated_mlp=llama_like,
        bias=not llama_like,
        learned_positions=not llama_like,
        tie_embeddings=bool(get("tie_word_embeddings", not llama_like)),
        dropout=bool(get("attention_dropout") or get("attn_pdrop")),
        flash_attention=True,
        hf_llama_activations=llama_like,
        name=str(get("model_type") or "hf"),
    )
