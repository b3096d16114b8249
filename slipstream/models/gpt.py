"""A LLaMA-style decoder-only transformer: the reference model of slipstream.

One file, readable in one sitting (in the spirit of nanoGPT): pre-norm RMSNorm blocks,
rotary position embeddings, grouped-query attention and a SwiGLU MLP, all linear layers
without bias. The math follows Hugging Face's ``LlamaForCausalLM`` (rotate-half RoPE,
fp32 RMSNorm, kv heads repeated consecutively), so weights can be copied one-to-one and
the logits match; tests pin that parity.

Module names are stable and HF-like because parallelism plans address them::

    embed_tokens
    layers.{i}.attn_norm, layers.{i}.attn.{q_proj,k_proj,v_proj,o_proj}
    layers.{i}.mlp_norm,  layers.{i}.mlp.{gate_proj,up_proj,down_proj}
    norm, lm_head

The model is single-device: it holds no process group. Three parameter-free parts are the
seams its plans (``slipstream.models.gpt_plans``, returned by :meth:`GPT.tp_plan` and
:meth:`GPT.sp_plan`) replace from outside: each attention's ``core`` (causal attention over
the local sequence), ``positions`` (where the input sits in the sequence) and ``output``
(logits to loss). Activation checkpointing runs through the model's ``recompute_context``
(``slipstream.parallel.recompute``), which an engine replaces by its own.

References: RoPE (Su et al. 2021, "RoFormer", sec. 3.4), GQA (Ainslie et al. 2023),
SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"), RMSNorm (Zhang & Sennrich 2019),
residual init scaling (Radford et al. 2019, GPT-2, sec. 2.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.models.decoding import generate_gpt
from slipstream.models.gpt_generation import cached_attention, forward_for_generation
from slipstream.models.gpt_moe import (
    GPTMoEConfig,
    MoEFeedForward,
    active_matmul_params,
    grouped_swiglu,
    init_expert_weights,
    is_moe_block,
)
from slipstream.models.gpt_plans import gpt_sp_plan, gpt_tp_plan
from slipstream.models.gpt_seams import CausalAttention, FullSequence, LMOutput, SequenceSpan
from slipstream.models.kv_cache import KVCache, LayerKV
from slipstream.moe.experts import register_grouped_expert
from slipstream.parallel.recompute import DEFAULT_CONTEXT, RecomputeContext
from slipstream.parallel.tensor import TPPlan
from slipstream.sequence import SPPlan
from slipstream.zero.init import deferred_init_active
from slipstream.zero.param import full_numel

__all__ = ["GPT", "GPTConfig", "GPTMoEConfig"]

_PRESETS: dict[str, dict[str, int]] = {
    # ~0.13M parameters: unit tests.
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64),
    # ~4.6M parameters: the demo default on a 2-core CPU.
    "small": dict(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, max_seq_len=256),
    # ~24M parameters: benchmarks.
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, max_seq_len=1024),
}


def _default_intermediate_size(hidden_size: int) -> int:
    """8/3 * hidden (keeps SwiGLU's 3 matrices at the FLOPs of a 4x GELU MLP), rounded up to 64."""
    return 64 * math.ceil(8 * hidden_size / 3 / 64)


@dataclass
class GPTConfig:
    """Shape and numerics of a :class:`GPT`. Validated at construction."""

    vocab_size: int = 256
    """Number of token ids; 256 matches :class:`slipstream.data.ByteTokenizer`."""
    hidden_size: int = 256
    """Width of the residual stream; must be divisible by ``num_heads``."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Number of query heads; head_dim = hidden_size // num_heads (must be even for RoPE)."""
    num_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); must divide ``num_heads``.
    None means ``num_heads`` (plain multi-head attention); resolved in ``__post_init__``."""
    intermediate_size: int | None = None
    """Hidden width of the SwiGLU MLP. None means 8/3 * hidden_size rounded up to a
    multiple of 64; resolved in ``__post_init__``."""
    max_seq_len: int = 256
    """Longest sequence the RoPE cache covers; longer inputs raise."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    tie_embeddings: bool = False
    """Share one matrix between ``embed_tokens`` and ``lm_head``."""
    dropout: float = 0.0
    """Dropout on attention probabilities and on each residual branch, in [0, 1)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them
    (``slipstream.parallel.recompute``, RNG state preserved so dropout matches; the
    ``activation_checkpointing`` config block picks full, partitioned, CPU or selective):
    activation memory drops from O(layers x block internals) to O(layers x hidden) at the
    cost of one extra forward per block. Only applies while autograd records."""
    sequence_parallel: str | None = None
    """Sequence-parallel attention once the model's sequence-parallel plan is applied
    (``slipstream.initialize`` with ``sequence_parallel_size > 1``, or
    ``slipstream.sequence.parallelize_sequence_``):
    "ulysses" (all-to-all, heads divisible by the sp size), "lss" (all-gathered K/V) or
    "ring" (zig-zag ring attention, any head count; the config's
    ``sequence_parallel_mode: "ring"`` cuts the batches zig-zag). Inputs are then this rank's
    sequence segment; RoPE positions follow its place in the sequence and the loss is the
    global mean. None, or no plan applied: an ordinary model."""
    moe: GPTMoEConfig | None = None
    """Mixture of experts: every ``moe.every``-th block's MLP becomes an MoE layer
    (``slipstream.models.gpt_moe``); its auxiliary losses are added to the loss. None: dense."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_seq_len"):
            _require_positive(name, getattr(self, name))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = _default_intermediate_size(self.hidden_size)
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("intermediate_size", self.intermediate_size)
        if self.hidden_size % self.num_heads != 0:
            raise ConfigError(
                f"GPTConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; choose a hidden_size that is a multiple of num_heads"
            )
        if (self.hidden_size // self.num_heads) % 2 != 0:
            raise ConfigError(
                f"GPTConfig head_dim=hidden_size/num_heads={self.hidden_size // self.num_heads} "
                "is odd; RoPE rotates pairs of channels, so pick hidden_size and num_heads "
                "giving an even head_dim"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"GPTConfig.num_kv_heads={self.num_kv_heads} does not divide "
                f"num_heads={self.num_heads}; set num_kv_heads to a divisor of num_heads"
            )
        if not self.rope_theta > 0:
            raise ConfigError(
                f"GPTConfig.rope_theta={self.rope_theta} must be > 0; the usual value is 10000.0"
            )
        if not self.norm_eps > 0:
            raise ConfigError(
                f"GPTConfig.norm_eps={self.norm_eps} must be > 0; the usual value is 1e-5"
            )
        if self.sequence_parallel not in (None, "ulysses", "lss", "ring"):
            raise ConfigError(
                f"GPTConfig.sequence_parallel={self.sequence_parallel!r} is not a sequence-"
                "parallel attention; use 'ulysses', 'lss', 'ring' or None"
            )
        if self.moe is not None and self.activation_checkpointing:
            raise ConfigError(
                "GPTConfig.moe with activation_checkpointing=True is not supported: the MoE "
                "auxiliary loss would not be back-propagated through the recomputed blocks; "
                "turn one of them off"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"GPTConfig.dropout={self.dropout} must be in [0, 1); use 0.0 to disable dropout"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named configuration: "tiny" (~0.13M params), "small" (~4.6M), "25m" (~24M).

        ``overrides`` replace preset fields, e.g. ``GPTConfig.preset("small", max_seq_len=128)``.

        Raises:
            ConfigError: unknown preset name or unknown override field.
        """
        if name not in _PRESETS:
            raise ConfigError(
                f"unknown GPTConfig preset {name!r}; valid presets are: {', '.join(_PRESETS)}"
            )
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ConfigError(
                f"unknown GPTConfig field(s) {unknown} in preset overrides; "
                f"valid fields are: {', '.join(sorted(valid))}"
            )
        base = cls(**_PRESETS[name])  # type: ignore[arg-type]
        # Re-derive intermediate_size from the new width unless it is given explicitly.
        if "hidden_size" in overrides and "intermediate_size" not in overrides:
            overrides["intermediate_size"] = None
        return replace(base, **overrides)  # type: ignore[arg-type]


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"GPTConfig.{name}={value!r} must be a positive integer; set it to an int >= 1"
        )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 and cast back (as HF Llama does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] by position; ``cos``/``sin`` are [T, D]."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary embeddings."""

    takes_kv_cache = True
    """Whether ``forward`` takes generation's ``mask`` and ``kv`` (a subclass may not)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads or config.num_heads
        self.head_dim = config.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.core: nn.Module = CausalAttention(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        """Attend ``x [B, T, hidden]``: causally through ``core`` (training), or, given
        generation's ``mask``/``kv``, against this layer's KV cache (``gpt_generation.py``)."""
        # Head counts come from the weights, not the config, so a tensor-parallel plan that
        # shards q/k/v by output rows keeps working with the local number of heads; the
        # length too (Megatron-SP: x holds a slice of the sequence, q/k/v all of it).
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t = q.shape[:2]
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if mask is None and kv is None:
            y = self.core(q, k, v)
        else:
            dropout = getattr(self.core, "dropout", 0.0) if self.training else 0.0
            y = cached_attention(q, k, v, mask, kv, dropout)
        return self.o_proj(y.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        inter = config.intermediate_size or _default_intermediate_size(config.hidden_size)
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# As MoE experts, copies of the MLP run as grouped GEMMs (slipstream.moe.experts).
register_grouped_expert(MLP, grouped_swiglu)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp: nn.Module = MLP(config)
        if is_moe_block(config, index):
            self.mlp = MoEFeedForward(config, self.mlp)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        # Generation's arguments only when given: a swapped-in attention may take 3 alone.
        extra = () if mask is None and kv is None else (mask, kv)
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), cos, sin, *extra))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Decoder-only language model.

    Construction initialises weights deterministically from the torch seed. For large
    models, build on the meta device and materialise later::

        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        model.init_weights()
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    recompute_context: RecomputeContext = DEFAULT_CONTEXT
    """Runs the checkpointed blocks (``config.activation_checkpointing``): the process-wide
    default until an engine gives the model its own (``use_recompute_context_``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        # Build on meta, then materialise: nn's default initialisers never run, so
        # init_weights() is the only consumer of the RNG and GPT(config) equals meta
        # construction + to_empty + init_weights() under the same seed, on any device.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.positions: SequenceSpan = FullSequence()
        self.output: nn.Module = LMOutput()
        # Non-persistent: state_dict holds parameters only; init_weights() fills these.
        shape = (config.max_seq_len, config.head_dim)
        self.register_buffer("rope_cos", torch.empty(shape, device=device), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, device=device), persistent=False)
        self.embed_dropout = nn.Dropout(config.dropout)
        if deferred_init_active():
            # Inside slipstream.zero.Init: parameters stay on the meta device and ZeRO-3
            # materializes them shard by shard with init_module_weights (same values).
            self.tie_weights()
            if not self.rope_cos.is_meta:
                self._init_rope()
            return
        self.to_empty(device=device)
        self.init_weights()

    def tp_plan(self, sequence_parallel: bool = False) -> TPPlan:
        """How tensor parallelism splits this model (``parallelize_tp_`` asks)."""
        return gpt_tp_plan(self, sequence_parallel)

    def sp_plan(self, sp_group: comm.Group) -> SPPlan:
        """How this model runs sequence-parallel over ``sp_group`` (``parallelize_sequence_``
        asks); needs ``config.sequence_parallel`` when the group has several ranks."""
        return gpt_sp_plan(self, sp_group, self.config.sequence_parallel, self.config.dropout)

    def tie_weights(self) -> None:
        """Make ``lm_head`` share ``embed_tokens.weight`` when ``config.tie_embeddings``.

        Called by ``__init__`` and ``init_weights``, because ``to_empty`` from the meta
        device replaces parameters and so breaks the tie.
        """
        if self.config.tie_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE cache in place.

        Linear and embedding weights ~ N(0, 0.02); the residual output projections
        (``o_proj``, ``down_proj``) use std 0.02 / sqrt(2 * num_layers) so the residual
        stream's variance does not grow with depth (GPT-2, sec. 2.3). Norm weights = 1.
        Deterministic given the torch seed.
        """
        self.tie_weights()
        for name, module in self.named_modules():
            self.init_module_weights(name, module)
        self._init_rope()

    @torch.no_grad()
    def init_module_weights(self, name: str, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters (one step of ``init_weights``).

        ``slipstream.zero.Init`` calls this per module, in ``named_modules`` order, to
        materialize ZeRO-3 shards with exactly the values eager construction gives.
        """
        std = 0.02
        if isinstance(module, nn.Linear):
            if module is self.lm_head and self.config.tie_embeddings:
                return  # shares embed_tokens.weight, already initialised
            if name.endswith(("o_proj", "down_proj")):
                std /= math.sqrt(2 * self.config.num_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        else:
            init_expert_weights(module, std, std / math.sqrt(2 * self.config.num_layers))

    def _init_rope(self) -> None:
        # Angles in fp32 on the buffer's device (fp32 keeps large positions exact enough),
        # then cast to the buffer's dtype, which follows model.to(dtype).
        cfg = self.config
        device = self.rope_cos.device
        inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
        )
        pos = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [T, head_dim], rotate-half layout
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Run the model.

        Args:
            input_ids: token ids, int64 [B, T] with T <= ``config.max_seq_len``.
            labels: optional targets aligned with ``input_ids`` (position t is predicted
                from ``input_ids[:, : t + 1]``); -100 marks positions to ignore.
            attention_mask, position_ids, kv_cache, logits_to_keep: generation's inputs
                (``slipstream.models.gpt_generation``): ``[B, past + T]`` with 0 for left
                padding, per-row RoPE positions ``[B, T]``, a ``KVCache`` holding ``past``
                positions (appended to), the number of last positions given logits (0: all).

        Returns:
            Mean cross-entropy loss (scalar, fp32) when ``labels`` is given, else logits
            [B, T, vocab_size] in the model's dtype. Under sequence parallelism ``input_ids``
            and ``labels`` are this rank's segment and the loss is that of the full sequences.

        Raises:
            ValueError: T (or a position) exceeds ``config.max_seq_len``, or the generation
                arguments do not fit together.
        """
        generating = attention_mask is not None or position_ids is not None or kv_cache is not None
        if generating or logits_to_keep:
            return forward_for_generation(
                self, input_ids, labels, attention_mask, position_ids, kv_cache, logits_to_keep
            )
        t = input_ids.shape[1]
        # Sequence parallel: input_ids is segment r of P; its RoPE positions start at r * t.
        start, total = self.positions.span(t)
        if total > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {total} exceeds GPTConfig.max_seq_len="
                f"{self.config.max_seq_len}; truncate the input or build the model with a "
                "larger max_seq_len"
            )
        x = self.embed_dropout(self.embed_tokens(input_ids))
        indices = getattr(self.positions, "indices", None)
        if indices is not None:  # ring attention: this rank's zig-zag positions
            where = indices(t, self.rope_cos.device)
            cos, sin = self.rope_cos[where].to(x.dtype), self.rope_sin[where].to(x.dtype)
        else:
            cos = self.rope_cos[start : start + t].to(x.dtype)
            sin = self.rope_sin[start : start + t].to(x.dtype)
        checkpointed = self.config.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if checkpointed:
                x = self.recompute_context.run(layer, x, cos, sin)
            else:
                x = layer(x, cos, sin)
        out: torch.Tensor = self.output(self.lm_head(self.norm(x)), labels)
        if labels is not None and self.config.moe is not None:
            for layer in self.layers:
                aux = getattr(layer.mlp, "aux_loss", None)
                if aux is not None:
                    out = out + aux
        return out

    def new_kv_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for up to ``max_len`` positions (prompt plus new tokens)."""
        if max_len > self.config.max_seq_len:
            raise ValueError(
                f"KV cache of {max_len} positions exceeds GPTConfig.max_seq_len="
                f"{self.config.max_seq_len}; generate fewer tokens or build a longer model"
            )
        return KVCache(len(self.layers), max_len)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``input_ids`` [B, T0].

        Runs slipstream's decode loop (:mod:`slipstream.models.decoding`) against the GPT's
        KV cache; past ``config.max_seq_len`` positions each further token is predicted from
        the last ``max_seq_len`` tokens (a sliding window, one loop call per token).
        ``slipstream.init_inference(model).generate(...)`` takes Hugging Face ``generate``'s
        arguments (padding, sampling, stopping) on the same loop. Does not change train/eval
        mode: call ``model.eval()`` first if dropout > 0.

        Args:
            input_ids: prompt, int64 [B, T0], T0 >= 1.
            max_new_tokens: number of tokens to append (>= 0).
            temperature: softmax temperature; 0 means greedy (argmax).
            top_k: keep only the k most likely tokens before sampling.
            generator: RNG for sampling, for reproducible output.

        Returns:
            int64 [B, T0 + max_new_tokens].

        Raises:
            ValueError: a negative count or temperature, or ``top_k`` < 1.
        """
        return generate_gpt(self, input_ids, max_new_tokens, temperature, top_k, generator)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied matrix counts once).

        ``exclude_embeddings`` drops the token embedding table (when tied, that is also
        ``lm_head``'s weight), the usual "non-embedding" count (Kaplan et al. 2020).
        """
        n = sum(full_numel(p) for p in self.parameters())  # also while ZeRO-3 partitioned
        if exclude_embeddings:
            n -= full_numel(self.embed_tokens.weight)
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), for MFU reporting.

        6 * N_matmul + 12 * L * H * D * T, after PaLM (Chowdhery et al. 2022, appendix B):
        N_matmul counts every weight used in a matmul (``lm_head`` included even when tied;
        the embedding lookup and norms do no matmul), and the second term is attention
        scores and weighted values over a context of T = ``seq_len`` (default
        ``max_seq_len``), counted without the causal halving, as PaLM does.
        """
        cfg = self.config
        t = cfg.max_seq_len if seq_len is None else seq_len
        n_matmul = active_matmul_params(self)  # with experts: the k a token uses
        return 6 * n_matmul + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t
