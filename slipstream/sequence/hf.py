"""Ulysses sequence parallelism for Hugging Face causal LMs, with no change to the model's code.

A transformers model looks its attention function up by name in the attention-function registry
(``transformers.AttentionInterface``, ``ALL_ATTENTION_FUNCTIONS``) under its config's
``_attn_implementation``. :func:`install_hf_ulysses_` registers a function that wraps the model's
own attention function (sdpa, eager, ...) in the Ulysses all-to-alls and points the config at it,
so LLaMA, Qwen2/3, Mistral and every other model built on the registry run on sequence shards:

* attention: the shard's queries, keys and values ``[B, H, S/P, D]`` become full-sequence,
  head-sharded ``[B, H/P, S, D]`` (one all-to-all each over the ``sp`` group, through
  :mod:`slipstream.distributed.comm`); the model's own attention function runs causally over
  the whole sequence on those heads; one all-to-all brings the output back. KV heads fewer
  than P are replicated before the exchange (each rank receives the one KV head its query
  heads use), as DeepSpeed's ALST does;
* positions: a forward pre-hook gives the model the shard's global ``position_ids`` when the
  batch has none (rank r of P holds positions r*S/P .. (r+1)*S/P-1), so RoPE rotates each token
  by its place in the full sequence;
* loss: the model's ``loss_function`` becomes the global token mean over the shards (token
  loss sums and token counts summed over ``sp``), read from ``shift_labels``: labels shifted
  on the *full* sequence before sharding (:func:`shard_causal_lm_batch`), so the target of each
  shard's last token, which sits on the next shard, is kept.

The attention mask: the registered name has no mask function, so transformers builds no mask
(no O(S^2) tensor) and attention is causal over the full sequence. A padding mask (zeros in
``attention_mask``) cannot be honoured this way and is refused; pad with ``labels = -100``
instead, which the loss ignores.

Packed rows (several documents per row, ``position_ids`` restarting at 0 per document): the
pre-hook reads the position ids of the shard, and when any rank of the group sees a restart
(one scalar all-reduce per forward that has position ids) the attention of that forward runs
the exact blockwise kernel of :mod:`slipstream.sequence.ring` on a ring of one rank after the
all-to-all (Ulysses x ring with ring size 1), masked to each token's own document: no
cross-document attention and no ``[S, S]`` mask.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_to_all_dims
from slipstream.sequence.loss import sequence_parallel_cross_entropy
from slipstream.sequence.ring import doc_starts, usp_attention_heads_first

__all__ = [
    "install_hf_ulysses_",
    "is_hf_attention_model",
    "is_ulysses_attention",
    "shard_causal_lm_batch",
    "ulysses_hf_attention",
]

_NAMES = itertools.count()


def is_hf_attention_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model that picks its attention function by name
    from the attention-function registry (its config has ``_attn_implementation``)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is installed with slipstream[hf]
        return False
    return isinstance(model, PreTrainedModel)


class _LocalHeads:
    """The attention module as the core attention function sees it after the all-to-all:
    every attribute is the module's, except ``num_key_value_groups``, which is the ratio of
    the *local* query heads to the local KV heads (different from the model's when KV heads
    were replicated)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _heads_error(model_name: str, heads: int, kv: int, p: int, tp: int = 1) -> str | None:
    """The refusal of head counts Ulysses cannot split over ``p`` ranks; with tensor
    parallelism of degree ``tp`` the counts are each TP rank's (the full ones / ``tp``)."""
    if tp > 1:
        local = _local_heads_error(heads // tp, kv // tp, p)
        if local is None:
            return None
        return (
            f"sequence_parallel_size={p} with tensor_parallel.autotp_size={tp}: {model_name} "
            f"has num_attention_heads={heads} and num_key_value_heads={kv}, so each TP rank "
            f"holds {heads // tp} query and {kv // tp} KV heads, and Ulysses over the sp "
            f'ranks {local}. Use ring attention ("sequence_parallel_mode": "ring", any '
            "head count), or sizes with (num_attention_heads / autotp_size) divisible by "
            "sequence_parallel_size"
        )
    if heads % p:
        return (
            f"sequence_parallel_size={p}: {model_name} has num_attention_heads={heads} "
            f"(num_key_value_heads={kv}), which Ulysses cannot split over {p} ranks (it "
            f"shards the query heads). Choose a sequence_parallel_size that divides {heads}"
        )
    if kv % p and p % kv:
        return (
            f"sequence_parallel_size={p}: {model_name} has num_key_value_heads={kv} "
            f"(num_attention_heads={heads}); Ulysses needs the KV heads to divide by "
            f"{p} or {p} to divide by them (then KV heads are replicated). Choose a "
            f"sequence_parallel_size that divides {kv} or is a multiple of it and divides {heads}"
        )
    return None


def _local_heads_error(heads: int, kv: int, p: int) -> str | None:
    """What Ulysses over ``p`` ranks cannot do with ``heads``/``kv`` heads, or None."""
    if heads % p:
        return f"cannot split {heads} query heads {p} ways"
    if kv % p and p % kv:
        return f"cannot split or replicate {kv} KV heads {p} ways"
    return None


class Packing:
    """The document starts (:func:`~slipstream.sequence.ring.doc_starts`) of this rank's
    tokens in the current forward; None when no row of the group packs documents."""

    doc: torch.Tensor | None = None


def _packed_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp_group: comm.Group,
    local_group: comm.Group,
    doc: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Ulysses attention of packed rows: the blockwise kernel on a ring of one rank."""
    refuse_kernel_gaps(
        module,
        kwargs.get("dropout"),
        kwargs,
        "sequence parallelism with packed documents",
        "do not pack documents",
    )
    s = q.shape[2] * comm.get_world_size(sp_group)
    if s % 2:
        raise ValueError(
            f"sequence parallelism with packed documents: the sequence has {s} tokens; the "
            "document-masked kernel needs an even length. Pad the rows (labels = -100)"
        )
    out = usp_attention_heads_first(
        q, k, v, sp_group, local_group, causal=True, scale=kwargs.get("scaling"), doc_start=doc
    )
    return out.transpose(1, 2), None


def ulysses_hf_attention(
    core: Callable[..., tuple[torch.Tensor, Any]],
    sp_group: comm.Group,
    *,
    core_name: str = "sdpa",
    packing: Packing | None = None,
    local_group: comm.Group | None = None,
) -> Callable[..., tuple[torch.Tensor, Any]]:
    """A transformers attention function running ``core`` under Ulysses over ``sp_group``.

    The result has the registry's signature ``fn(module, query, key, value, attention_mask,
    **kwargs) -> (output [B, S/P, H, D], weights)`` with ``query [B, H, S/P, D]`` and
    ``key``/``value`` ``[B, kv, S/P, D]`` of this rank's shard. ``core`` is the model's own
    function (``ALL_ATTENTION_FUNCTIONS["sdpa"]``, the eager one, ...); it sees
    ``[B, H/P, S, D]`` queries and no mask (causal over the full sequence; for ``eager``,
    which applies only the mask it is given, a full causal mask is built). When
    ``packing.doc`` is set (packed rows), the document-masked blockwise kernel runs instead,
    on ``local_group`` (a group of this rank alone) as its ring.
    """

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        p = comm.get_world_size(sp_group)
        heads, kv, local = query.shape[1], key.shape[1], query.shape[2]
        message = _heads_error(type(module).__name__, heads, kv, p)
        if message is not None:
            raise ValueError(message)
        window = kwargs.get("sliding_window")
        if window is not None and local * p > window:
            raise ValueError(
                f"sequence parallelism: {type(module).__name__} uses sliding-window attention "
                f"(sliding_window={window}) and the sequence has {local * p} tokens; the "
                "Ulysses attention is causal over the whole sequence. Use sequences of at most "
                "sliding_window tokens or disable the window in the model config"
            )
        if packing is not None and packing.doc is not None and local_group is not None:
            return _packed_attention(
                module, query, key, value, sp_group, local_group, packing.doc, kwargs
            )
        if kv < p:  # one KV head per rank: replicate so each rank gets the head it uses
            key = key.repeat_interleave(p // kv, dim=1)
            value = value.repeat_interleave(p // kv, dim=1)
        q, k, v = (
            all_to_all_dims(t, sp_group, scatter_dim=1, gather_dim=2) for t in (query, key, value)
        )
        view = _LocalHeads(module, q.shape[1] // k.shape[1])
        mask, kernel = None, core
        if core_name == "eager":  # eager masks only what it is given: the full causal mask
            kernel = getattr(sys.modules[type(module).__module__], "eager_attention_forward", core)
            s = q.shape[2]
            mask = torch.full((s, s), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
            mask = mask.triu(1)[None, None]
        out, weights = kernel(view, q, k, v, mask, *args, **kwargs)
        # The core returns [B, S, H/P, D]: back to this rank's tokens and all heads.
        return all_to_all_dims(out, sp_group, scatter_dim=1, gather_dim=2), weights

    attention._slipstream_ulysses = True  # type: ignore[attr-defined]
    return attention


def is_ulysses_attention(fn: Any) -> bool:
    """Whether ``fn`` already runs Ulysses (a function of this module or one registered by
    DeepSpeed's ALST entry point ``UlyssesSPAttentionHF.register_with_transformers``)."""
    return bool(getattr(fn, "_slipstream_ulysses", False))


def _sp_loss(sp_group: comm.Group) -> Callable[..., torch.Tensor]:
    """The model's ``loss_function`` under sequence parallelism (see the module docs)."""

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            raise ValueError(
                "sequence parallelism: the batch has labels but no shift_labels. Shifting "
                "labels inside each sequence shard would drop the target of every shard's "
                "last token; shard batches with slipstream.sequence.shard_causal_lm_batch "
                "(initialize's dataloader does), which shifts labels on the full sequence"
            )
        if num_items_in_batch is not None:
            raise ValueError(
                "sequence parallelism: num_items_in_batch (the Trainer's token count for "
                "gradient accumulation) is not supported with sequence_parallel_size > 1; "
                "the loss is already the global token mean over the sequence shards"
            )
        return sequence_parallel_cross_entropy(
            logits.view(*shift_labels.shape, vocab_size),
            shift_labels.to(logits.device),
            sp_group,
            ignore_index=ignore_index,
        )

    return loss_function


def _positions_hook(sp_group: comm.Group, packing: Packing | None = None) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise ValueError(
                    "sequence parallelism: an attention_mask with padding (or a 4-D mask) "
                    "cannot be applied to sequence shards; drop attention_mask and mark "
                    "padded positions with labels = -100 (attention is causal over the "
                    "full sequence)"
                )
            kwargs["attention_mask"] = None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if kwargs.get("position_ids") is None:
            if ids is not None:
                local = ids.shape[1]
                start = comm.get_rank(sp_group) * local
                pos = torch.arange(start, start + local, device=ids.device)
                kwargs["position_ids"] = pos.unsqueeze(0).expand(ids.shape[0], -1)
            if packing is not None:
                packing.doc = None
        elif packing is not None and ids is not None:
            _read_packing(kwargs["position_ids"], ids.shape[0], sp_group, packing)
        kwargs.setdefault("use_cache", False)
        return args, kwargs

    return hook


def _read_packing(pos: torch.Tensor, batch: int, sp_group: comm.Group, packing: Packing) -> None:
    """Set ``packing.doc`` (``[B, S/P]``) from this shard's position ids when any rank of
    ``sp_group`` sees a document restart (position ids not ``start .. start + S/P - 1``)."""
    local = pos.shape[-1]
    start = comm.get_rank(sp_group) * local
    index = torch.arange(start, start + local, device=pos.device)
    doc = doc_starts(pos.reshape(-1, local), index).expand(batch, -1)
    publish_packing(doc, sp_group, packing, label="sp.packed")


def publish_packing(doc: torch.Tensor, sp_group: comm.Group, packing: Packing, label: str) -> None:
    """Set ``packing.doc`` to this rank's document starts ``doc`` if any rank of ``sp_group``
    has a document restart in its shard, else to None (one flag all-reduce, so every rank of
    the group takes the same kernel)."""
    packed = torch.tensor([float(bool((doc != 0).any()))], device=doc.device)
    comm.all_reduce(packed, group=sp_group, label=label)
    packing.doc = doc if bool(packed.item()) else None


def refuse_kernel_gaps(
    module: nn.Module, dropout: float | None, kwargs: dict[str, Any], what: str, fix: str
) -> None:
    """Refuse what a blockwise attention kernel (``what``) does not apply: attention dropout
    in training, ``sliding_window`` and ``softcap``; ``fix`` ends the last two messages."""
    name = type(module).__name__
    if dropout and module.training:
        raise ValueError(
            f"{what}: {name} has attention dropout {dropout}, which its kernel does not "
            "apply; set the model config's attention_dropout to 0"
        )
    for key in ("sliding_window", "softcap"):
        if kwargs.get(key) is not None:
            raise ValueError(
                f"{what}: {name} uses {key}={kwargs[key]}, which its kernel does not apply; "
                f"disable it in the model config or {fix}"
            )


def _check_causal_lm(model: nn.Module) -> None:
    """The loss and the label shift are a causal LM's: refuse other model classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        raise ValueError(
            f"sequence_parallel_size > 1 with the Hugging Face model {name}: slipstream's "
            "Ulysses for Hugging Face models covers causal LMs (the *ForCausalLM classes), "
            "whose labels it shifts and whose loss it replaces. Set sequence_parallel_size to "
            "1, or route the model's attention through slipstream.sequence.DistributedAttention"
        )


def install_hf_ulysses_(
    model: nn.Module,
    sp_group: comm.Group,
    local_group: comm.Group | None = None,
    tp_size: int = 1,
) -> str:
    """Make a transformers causal LM train on sequence shards over ``sp_group``, in place.

    Registers a Ulysses attention function wrapping the model's current one under a new name
    (``AttentionInterface.register``) and sets ``model.config._attn_implementation`` to it,
    sets ``model.loss_function`` to the global token mean over the shards, and adds a forward
    pre-hook that supplies global ``position_ids`` and refuses padding masks.
    ``slipstream.initialize`` calls this when ``sequence_parallel_size > 1``. With
    ``local_group`` (a group of this rank alone, e.g. the ring group of
    ``slipstream.distributed.mesh.sp_ring_groups(mesh, 1)``) packed rows attend within their
    documents (see the module docs); without it position ids are taken as they are.
    ``tp_size``: the tensor-parallel degree the model is already split over; the all-to-alls
    then move each TP rank's ``heads / tp_size`` heads, which must split over ``sp_group``.

    When the model's implementation is already routed through Ulysses (DeepSpeed's
    ``UlyssesSPAttentionHF.register_with_transformers``), nothing is changed.

    Returns:
        The attention name the model uses.
    Raises:
        ValueError: the head counts cannot be split over the group (names the model, the
            counts and the sizes that work).
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = model.config
    p = comm.get_world_size(sp_group)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    message = _heads_error(type(model).__name__, heads, kv, p, tp_size)
    if message is not None:
        raise ValueError(message)
    core_name = config._attn_implementation or "sdpa"
    if core_name.startswith("slipstream_ulysses"):
        raise ValueError(
            f"{type(model).__name__} already runs Ulysses attention ({core_name}): a model "
            "can be prepared for sequence parallelism once"
        )
    if is_ulysses_attention(ALL_ATTENTION_FUNCTIONS.get(core_name)):
        # An ALST script registered Ulysses under this name already (and computes its loss
        # from shift_labels itself): nothing more to install.
        return str(core_name)
    _check_causal_lm(model)
    if core_name == "eager":  # each modeling file has its own; looked up per call
        from transformers.models.llama.modeling_llama import eager_attention_forward

        core: Callable[..., tuple[torch.Tensor, Any]] = eager_attention_forward
    else:
        core = ALL_ATTENTION_FUNCTIONS[core_name]
    name = f"slipstream_ulysses_{core_name}_{next(_NAMES)}"
    packing = Packing() if local_group is not None else None
    fn = ulysses_hf_attention(
        core, sp_group, core_name=core_name, packing=packing, local_group=local_group
    )
    AttentionInterface.register(name, fn)
    config._attn_implementation = name
    model.loss_function = _sp_loss(sp_group)  # type: ignore[assignment]
    model.register_forward_pre_hook(_positions_hook(sp_group, packing), with_kwargs=True)
    return name


def full_sequence_fields(
    batch: dict[str, Any], ids: torch.Tensor, ignore_index: int, mode: str, hint: str
) -> dict[str, Any]:
    """A copy of ``batch`` ready to be cut into sequence shards: ``attention_mask`` dropped
    (refused when it has padding: ``mode`` attention is causal over the full sequence;
    ``hint`` adds another way out), ``position_ids`` made ``0..S-1`` when absent, and
    ``labels`` shifted on the full sequence into ``shift_labels`` (and ``labels``)."""
    b, s = ids.shape[0], ids.shape[1]
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError(
            f"sequence parallelism: the batch's attention_mask has padding (zeros); {mode} "
            "attention is causal over the full sequence and cannot apply it. Drop "
            f"attention_mask and set labels = -100 on the padded positions{hint}"
        )
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, -1)
    labels = out.get("labels")
    if labels is not None and out.get("shift_labels") is None:
        out["shift_labels"] = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
        out["labels"] = out["shift_labels"]
    return out


def shard_causal_lm_batch(
    batch: dict[str, Any], sp_world_size: int, sp_rank: int, ignore_index: int = -100
) -> dict[str, Any]:
    """This sp rank's shard of a causal-LM batch ``{input_ids, labels?, position_ids?, ...}``.

    ``labels [B, S]`` are shifted on the full sequence (``shift_labels[:, i] = labels[:, i+1]``,
    ``ignore_index`` at the end) before sharding, so no target is lost at shard edges; the
    shard carries ``shift_labels`` and ``labels`` (the model computes a loss only when labels
    are given; the installed loss reads ``shift_labels``). ``position_ids`` are taken from the
    full sequence (``arange(S)`` unless the batch has them). An all-ones ``attention_mask`` is
    dropped. Every other ``[B, S, ...]`` tensor is sliced; rank r keeps r*S/P .. (r+1)*S/P-1.

    Raises:
        ValueError: a length not divisible by ``sp_world_size``; a padding attention mask.
    """
    if "input_ids" in batch:
        ids = batch["input_ids"]
    elif "inputs_embeds" in batch:
        ids = batch["inputs_embeds"]
    else:
        raise ValueError(
            f"shard_causal_lm_batch needs input_ids or inputs_embeds, got keys {sorted(batch)}"
        )
    s = ids.shape[1]
    if s % sp_world_size:
        raise ValueError(
            f"sequence parallelism: sequence length {s} (input shape {tuple(ids.shape)}) is "
            f"not divisible by sequence_parallel_size={sp_world_size}; pad the sequences "
            "(labels = -100 on the padding) or crop them to a multiple of it"
        )
    out = full_sequence_fields(batch, ids, ignore_index, "Ulysses", "")
    chunk = s // sp_world_size
    lo, hi = sp_rank * chunk, (sp_rank + 1) * chunk
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == s:
            out[key] = value[:, lo:hi].contiguous()
    return out
