"""Memory tiling for Hugging Face causal LMs, with no change to the model's code.

Two in-place transforms (``slipstream.initialize`` applies them from the ``tiled_compute``
config block; both work alone, with Ulysses, activation checkpointing and ZeRO 0-3):

* :func:`tile_hf_mlp_`: every gated MLP of the model (a module with ``gate_proj``,
  ``up_proj`` and ``down_proj``: LLaMA, Mistral, Qwen2/3, Gemma and their relatives) runs
  through :class:`~slipstream.sequence.tiling.TiledMLP` over chunks of its tokens. Its
  ``[tokens, intermediate]`` activations exist for one chunk at a time.
* :func:`tile_hf_loss_`: in training, a forward with ``labels`` (or ``shift_labels``) runs
  the base model, then the output projection and the cross-entropy over chunks of tokens
  (:class:`~slipstream.sequence.tiling.TiledFusedLogitsLoss`), so the ``[S, vocab]`` logits
  never exist; the output carries the loss and ``logits=None``. The loss is the model's
  own: mean token cross-entropy in fp32 of the labels shifted by one (``-100`` ignored),
  divided by ``num_items_in_batch`` when the Trainer passes it; under sequence parallelism,
  the global token mean over the shards (as :func:`slipstream.sequence.hf.install_hf_ulysses_`
  computes it). A forward without labels, or in eval mode, is the model's unchanged.

Chunk counts ("auto", the default): the MLP's ``ceil(tokens / hidden_size)`` (ALST's rule: a
chunk's intermediate is about as large as one weight matrix) and the loss's
``ceil(vocab_size / hidden_size)``, capped so a chunk keeps at least 64 tokens (a logits chunk
is then no larger than the hidden states of the whole sequence).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_reduce_scalar
from slipstream.sequence.tiling import TiledFusedLogitsLoss, TiledMLP

__all__ = ["tile_hf_loss_", "tile_hf_mlp_", "tiled_causal_lm_loss"]

_TILED = "_slipstream_tiled"
_MIN_LOSS_CHUNK = 64
# Configurations whose forward changes the logits or adds to the loss after the projection.
_REFUSED_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, n, None), nn.Module)
        for n in ("gate_proj", "up_proj", "down_proj")
    )


def tile_hf_mlp_(model: nn.Module, shards: int | None = None) -> int:
    """Run every gated MLP of ``model`` over ``shards`` chunks of tokens (None: "auto"), in
    place; the module's own ``forward`` computes each chunk. Returns how many were tiled.

    Raises:
        ValueError: the model has no gated MLP (names what was looked for); ``shards < 1``.
    """
    if shards is not None and shards < 1:
        raise ValueError(f'tiled_compute.mlp_shards={shards}: must be at least 1 (or "auto")')
    mlps = [m for m in model.modules() if _is_gated_mlp(m) and not getattr(m, _TILED, False)]
    if not mlps and not any(getattr(m, _TILED, False) for m in model.modules()):
        raise ValueError(
            f"tiled_compute.mlp: {type(model).__name__} has no gated MLP module (with "
            "gate_proj, up_proj and down_proj, as LLaMA, Mistral and Qwen have) to tile; set "
            "tiled_compute.mlp to false, or tile your MLP with "
            "slipstream.sequence.tiling.TiledMLP.apply"
        )
    for mlp in mlps:
        mlp.forward = _tiled_mlp_forward(mlp, mlp.forward, shards)  # type: ignore[method-assign]
        setattr(mlp, _TILED, True)
    return len(mlps)


def _tiled_mlp_forward(
    module: nn.Module, original: Callable[[torch.Tensor], torch.Tensor], shards: int | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def chunk_forward(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return original(x)

    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        n = shards if shards is not None else math.ceil(tokens / x.shape[-1])
        n = max(1, min(n, tokens))
        if n == 1:
            return original(x)
        return TiledMLP.apply(chunk_forward, module, x, n, None)

    return forward


def _loss_shards(tokens: int, vocab: int, hidden: int, shards: int | None) -> int:
    if shards is None:
        shards = min(math.ceil(vocab / hidden), math.ceil(tokens / _MIN_LOSS_CHUNK))
    return max(1, min(shards, tokens))


def _token_ce_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def tiled_causal_lm_loss(
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    head: nn.Module,
    shards: int | None = None,
    sp_group: comm.Group = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy of ``head(hidden)`` against ``shift_labels`` (``-100``
    ignored), computed over chunks of tokens so the logits of the whole sequence never exist.

    Args:
        hidden: ``[B, S, H]`` final hidden states (of this rank's shard under SP).
        shift_labels: ``[B, S]`` targets, already shifted by one on the full sequence.
        head: the output projection (``model.get_output_embeddings()``).
        shards: chunk count (None: "auto", see the module docs).
        sp_group: the sequence-parallel group: the token sums and counts are summed over
            it (the loss is the global token mean, the same on every rank).
        num_items_in_batch: divide the token sum by this instead of the token count
            (the Trainer's gradient-accumulation count; refused under SP).
    """
    tokens = shift_labels.numel()
    vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])  # type: ignore[union-attr, index]
    n = _loss_shards(tokens, vocab, hidden.shape[-1], shards)
    total = TiledFusedLogitsLoss.apply(
        _token_ce_sum, head, hidden, shift_labels.to(hidden.device), None, n, None, "sum"
    )
    if sp_group is not None and comm.get_world_size(sp_group) > 1:
        if num_items_in_batch is not None:
            raise ValueError(
                "sequence parallelism: num_items_in_batch (the Trainer's token count for "
                "gradient accumulation) is not supported with sequence_parallel_size > 1; "
                "the loss is already the global token mean over the sequence shards"
            )
        count = (shift_labels != -100).sum().to(total.dtype)
        comm.all_reduce(count, group=sp_group, label="sp.token_count")
        return all_reduce_scalar(total, sp_group) / count.clamp(min=1)
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, device=total.device).to(total.dtype)
    return total / (shift_labels != -100).sum().clamp(min=1).to(total.dtype)


def tile_hf_loss_(model: nn.Module, shards: int | None = None, sp_group: comm.Group = None) -> None:
    """Compute ``model``'s training loss without its ``[S, vocab]`` logits, in place (see the
    module docs). ``sp_group``: the sequence-parallel group when the model trains on
    sequence shards (labels then come as ``shift_labels``, shifted on the full sequence).

    Raises:
        ValueError: not a transformers causal LM with a base model and an output projection;
            a config that rescales the logits (softcapping, logit scale) or adds a router
            loss; ``shards < 1``.
    """
    if shards is not None and shards < 1:
        raise ValueError(
            f'tiled_compute.logits_loss_shards={shards}: must be at least 1 (or "auto")'
        )
    if getattr(model, _TILED, False):
        return
    _check_loss_model(model)
    original = model.forward
    signature = inspect.signature(original)

    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        shift_labels = kwargs.get("shift_labels")
        if args:
            bound = signature.bind_partial(*args, **kwargs)
            kwargs = {**bound.arguments.pop("kwargs", {}), **bound.arguments}
            labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        if not model.training or (labels is None and shift_labels is None):
            return original(**kwargs)
        return _tiled_forward(model, kwargs, shards, sp_group)

    model.forward = forward  # type: ignore[method-assign]
    setattr(model, _TILED, True)


def _check_loss_model(model: nn.Module) -> None:
    name = type(model).__name__
    config = getattr(model, "config", None)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if config is None or not isinstance(base, nn.Module) or not isinstance(head, nn.Linear):
        raise ValueError(
            f"tiled_compute.logits_loss: {name} is not a Hugging Face causal LM with a base "
            "model and a linear output projection (get_output_embeddings()); set "
            "tiled_compute.logits_loss to false or call "
            "slipstream.sequence.hf_tiling.tiled_causal_lm_loss on your hidden states"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _REFUSED_CONFIG:
        if getattr(text, key, None) not in (None, 1.0, 0.0, False):
            raise ValueError(
                f"tiled_compute.logits_loss: {name} sets config.{key}={getattr(text, key)!r}, "
                "which transforms the logits after the projection; the tiled loss computes "
                "the plain cross-entropy of the projection. Set tiled_compute.logits_loss to false"
            )
    if getattr(text, "output_router_logits", False):
        raise ValueError(
            f"tiled_compute.logits_loss: {name} adds a router auxiliary loss "
            "(output_router_logits=True) that the tiled loss would drop; set "
            "tiled_compute.logits_loss to false or output_router_logits to false"
        )


def _tiled_forward(
    model: nn.Module, kwargs: dict[str, Any], shards: int | None, sp_group: comm.Group
) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    sp = sp_group is not None and comm.get_world_size(sp_group) > 1
    if shift_labels is None:
        if sp:
            raise ValueError(
                "sequence parallelism: the batch has labels but no shift_labels. Shifting "
                "labels inside each sequence shard would drop the target of every shard's "
                "last token; shard batches with slipstream.sequence.shard_causal_lm_batch "
                "(initialize's dataloader does), which shifts labels on the full sequence"
            )
        assert labels is not None
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    base = getattr(model, getattr(model, "base_model_prefix", "model"))
    outputs = base(**kwargs, return_dict=True)
    loss = tiled_causal_lm_loss(
        outputs.last_hidden_state,
        shift_labels,
        model.get_output_embeddings(),  # type: ignore[operator, arg-type]
        shards,
        sp_group if sp else None,
        num_items,
    )
    # The base output's other fields (cache, hidden_states, attentions) carry over by name.
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)
