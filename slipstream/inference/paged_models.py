"""The forwards of the models the paged engine drives, over their own modules and weights,
with attention over the paged KV cache (:meth:`PagedKVCache.attend`).

A step's tokens, from every sequence of the batch, are one flat ``[tokens]`` row: the
projections, norms and MLPs run on ``[tokens, hidden]`` as one batch (a decode token of one
sequence and a prefill chunk of another share every GEMM), and only attention looks at which
sequence a token belongs to. Each forward calls the model's own submodules (embeddings,
norms, projections, MLPs, rotary tables) and does the rest itself: the rotary rotation, the
split into heads and the attention. Supported: slipstream's GPT; Hugging Face LLaMA-family
models (``llama``, ``mistral``, ``qwen2``, ``qwen3``; grouped-query attention); GPT-2 and
OPT. Anything else is refused by :func:`runner_for`, naming the model type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference.fused import FusedLlama, fuse_llama
from slipstream.inference.paged import PagedKVCache

__all__ = ["Gather", "Runner", "runner_for"]

Gather = Callable[[Sequence[nn.Parameter]], AbstractContextManager[Any]]
"""Makes the given parameters whole for the length of a block (ZeRO-3's
``GatheredParameters``): the runner of a model whose parameters are gathered per layer."""

Scope = Callable[[nn.Module], AbstractContextManager[Any]]


def _no_scope(module: nn.Module) -> AbstractContextManager[Any]:
    return nullcontext()


LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, dim]`` by ``cos``/``sin`` ``[tokens, dim]``."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


@dataclass
class Runner:
    """One model's paged forward and the cache geometry it needs."""

    model: nn.Module
    kind: str
    num_layers: int
    kv_heads: int
    head_dim: int
    context: int | None
    vocab_size: int
    fused: FusedLlama | None = None
    """LLaMA family, fp32 on the CPU: the fused, packed projections (``fused.py``)."""
    gather: Gather | None = None
    """Parameters held partitioned between forwards (unpinned ZeRO-3): each forward gathers
    the rest of the model (embeddings, final norm, LM head) for the whole step
    (:meth:`step_scope`) and each transformer block for its own part of it, one block at a
    time, as ZeRO-3's hooks do for a module forward."""
    layers: list[nn.Module] = field(default_factory=list)
    """The transformer blocks, in order (what :attr:`gather` gathers one at a time)."""

    def step_scope(self) -> AbstractContextManager[Any]:
        """The block one forward (hidden states and logits) runs in: with :attr:`gather`,
        the parameters outside the transformer blocks are whole inside it."""
        if self.gather is None:
            return nullcontext()
        inside = {id(p) for layer in self.layers for p in layer.parameters()}
        rest = [p for p in self.model.parameters() if id(p) not in inside]
        return self.gather(rest)

    def _layer_scope(self, layer: nn.Module) -> AbstractContextManager[Any]:
        if self.gather is None:
            return nullcontext()
        return self.gather(list(layer.parameters()))

    def keep_pace(self) -> None:
        """The collectives of one forward without its compute: a process with nothing to
        decode calls it while others still decode, when every forward is a collective
        (:attr:`gather`: the same gathers, in the same order, as :meth:`hidden` and
        :meth:`logits` make inside :meth:`step_scope`)."""
        with self.step_scope():
            for layer in self.layers:
                with self._layer_scope(layer):
                    pass

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of flat ``ids``/``pos`` ``[tokens]``
        (the cache's layout planned for them)."""
        if self.fused is not None:
            self.fused.refresh()  # rebuilt only when a weight changed
            return _llama(self.model, ids, pos, cache, self._layer_scope, self.fused)
        return _FORWARDS[self.kind](self.model, ids, pos, cache, self._layer_scope)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.head is not None:
            return self.fused.head(hidden)
        head: Any = self.model.get_submodule("lm_head")
        if self.kind == "gpt":  # its output seam: a tensor-parallel GPT gathers the vocabulary
            seam: Any = self.model.get_submodule("output")
            return seam(head(hidden))  # type: ignore[no-any-return]
        return head(hidden)  # type: ignore[no-any-return]


def _heads(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, dim)


def _gpt(
    model: Any, ids: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, scope: Scope = _no_scope
) -> torch.Tensor:
    x = model.embed_tokens(ids)
    cos, sin = model.rope_cos[pos].to(x.dtype), model.rope_sin[pos].to(x.dtype)
    for i, layer in enumerate(model.layers):
        with scope(layer):
            attn, h = layer.attn, layer.attn_norm(x)
            d = attn.head_dim
            q = _rope(_heads(attn.q_proj(h), d), cos, sin)
            k = _rope(_heads(attn.k_proj(h), d), cos, sin)
            y = cache.attend(i, q, k, _heads(attn.v_proj(h), d), None)
            x = x + attn.o_proj(y.flatten(1))
            x = x + layer.mlp(layer.mlp_norm(x).unsqueeze(0)).squeeze(0)
    return model.norm(x)  # type: ignore[no-any-return]


def _llama(
    model: Any,
    ids: torch.Tensor,
    pos: torch.Tensor,
    cache: PagedKVCache,
    scope: Scope = _no_scope,
    fused: FusedLlama | None = None,
) -> torch.Tensor:
    body = model.model
    x = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(x.unsqueeze(0), pos.unsqueeze(0))
    cos, sin = cos[0], sin[0]
    for i, layer in enumerate(body.layers):
        with scope(layer):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            d = attn.head_dim
            if fused is not None:
                q, k, v = fused.attention_inputs(i, h)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q, k, v = _heads(q, d), _heads(k, d), _heads(v, d)
            if hasattr(attn, "q_norm"):  # qwen3: a norm over each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            y = cache.attend(i, q, k, v, attn.scaling).flatten(1)
            x = x + (attn.o_proj(y) if fused is None else fused.attention_output(i, y))
            h = layer.post_attention_layernorm(x)
            x = x + (layer.mlp(h) if fused is None else fused.mlp(i, h))
    return body.norm(x)  # type: ignore[no-any-return]


def _gpt2(
    model: Any, ids: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, scope: Scope = _no_scope
) -> torch.Tensor:
    body = model.transformer
    x = body.wte(ids) + body.wpe(pos)
    for i, block in enumerate(body.h):
        with scope(block):
            attn = block.attn
            d = attn.head_dim
            q, k, v = attn.c_attn(block.ln_1(x)).split(attn.split_size, dim=1)
            scale = d**-0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            y = cache.attend(i, _heads(q, d), _heads(k, d), _heads(v, d), scale)
            x = x + attn.c_proj(y.flatten(1))
            x = x + block.mlp(block.ln_2(x))
    return body.ln_f(x)  # type: ignore[no-any-return]


def _opt(
    model: Any, ids: torch.Tensor, pos: torch.Tensor, cache: PagedKVCache, scope: Scope = _no_scope
) -> torch.Tensor:
    dec = model.model.decoder
    x = dec.embed_tokens(ids)
    if dec.project_in is not None:
        x = dec.project_in(x)
    positions = dec.embed_positions
    x = x + positions.weight[pos + getattr(positions, "offset", 2)]
    for i, layer in enumerate(dec.layers):
        with scope(layer):
            attn, pre = layer.self_attn, layer.do_layer_norm_before
            h = layer.self_attn_layer_norm(x) if pre else x
            d = attn.head_dim
            q, k, v = (_heads(p(h), d) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            x = x + attn.out_proj(cache.attend(i, q, k, v, attn.scaling).flatten(1))
            if not pre:
                x = layer.self_attn_layer_norm(x)
            h = layer.final_layer_norm(x) if pre else x
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
            if not pre:
                x = layer.final_layer_norm(x)
    if dec.final_layer_norm is not None:
        x = dec.final_layer_norm(x)
    if dec.project_out is not None:
        x = dec.project_out(x)
    return x  # type: ignore[no-any-return]


_FORWARDS = {"gpt": _gpt, "llama": _llama, "gpt2": _gpt2, "opt": _opt}


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(
        f"ContinuousBatchingEngine: {type(model).__name__} {why}; the paged engine drives "
        f"slipstream's GPT and Hugging Face {', '.join(LLAMA_FAMILY)}, gpt2 and opt causal LMs "
        "(use slipstream.inference.generate, the static engine, for other models)"
    )


def _rows(weight: torch.Tensor) -> int:
    """Output features of a projection's weight, also while ZeRO-3 holds it partitioned
    (an empty placeholder whose whole shape is DeepSpeed's ``ds_shape``)."""
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def runner_for(model: nn.Module, *, fuse: bool = True, gather: Gather | None = None) -> Runner:
    """The paged forward of ``model``; ``fuse``: LLaMA-family models in fp32 on the CPU run
    their projections fused and pre-packed (``fused.py``; one more copy of their weights);
    ``gather``: the model's parameters are partitioned between forwards and each forward
    gathers them (:attr:`Runner.gather`; no fused copy is made then).

    Raises:
        ConfigError: a model type the paged engine does not drive, or a setting of a
            supported one it does not implement (named in the message).
    """
    from slipstream.inference.generation import driver_for
    from slipstream.models.gpt import GPT

    context = driver_for(model).context_length(model)  # also refuses non-causal LMs
    config: Any = getattr(model, "config", None)
    m: Any = model
    if isinstance(model, GPT):
        first = m.layers[0].attn
        kv = _rows(first.k_proj.weight) // first.head_dim
        return Runner(model, "gpt", len(m.layers), kv, first.head_dim, context,
                      model.config.vocab_size, None, gather, list(m.layers))  # fmt: skip
    kind = getattr(config, "model_type", None)
    if kind in LLAMA_FAMILY:
        attn = m.model.layers[0].self_attn
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and context and window < context:
            context = int(window)  # attention is full inside the window: cap the length there
        kv = _rows(attn.k_proj.weight) // attn.head_dim
        layers = len(m.model.layers)
        fused = fuse_llama(model) if fuse and gather is None else None
        return Runner(model, "llama", layers, kv, int(attn.head_dim), context, config.vocab_size,
                      fused, gather, list(m.model.layers))  # fmt: skip
    if kind == "gpt2":
        if getattr(config, "add_cross_attention", False):
            raise _refuse(model, "has cross-attention (add_cross_attention=True)")
        heads = config.n_head
        return Runner(model, "gpt2", config.n_layer, heads, config.n_embd // heads, context,
                      config.vocab_size, None, gather, list(m.transformer.h))  # fmt: skip
    if kind == "opt":
        attn = m.model.decoder.layers[0].self_attn
        layers = len(m.model.decoder.layers)
        return Runner(model, "opt", layers, attn.num_heads, attn.head_dim, context,
                      config.vocab_size, None, gather, list(m.model.decoder.layers))  # fmt: skip
    raise _refuse(model, f"(model_type={kind!r}) is not a model type it implements")
