"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Arctic Long Sequence
Training's Ulysses entry points for Hugging Face models, with DeepSpeed 0.19.8's signatures.

An ALST script registers Ulysses over the model's attention implementation, passes the returned
groups to ``initialize(mpu=...)``, wraps its dataloader in :class:`UlyssesSPDataLoaderAdapter`
and computes the loss itself from ``shift_labels``::

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=1)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank, sp_group, sp_world_size, device)

``TiledMLP``, ``TiledFusedLogitsLoss`` and ``sequence_tiled_compute`` (ALST's memory tiling)
are :mod:`slipstream.sequence.tiling`'s, with DeepSpeed's ``apply`` signatures.

The attention exchange is slipstream's (:func:`slipstream.sequence.hf.ulysses_hf_attention`:
all-to-alls through the comm layer, KV heads replicated when fewer than P). The loss and the
position ids are the script's business here, as in DeepSpeed; ``initialize`` without ``mpu`` and
with ``sequence_parallel_size`` does all of it for you (docs/parallelism.md).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.runtime.sequence_parallel import parallel_state_sp
from slipstream.sequence.hf import ulysses_hf_attention
from slipstream.sequence.tiling import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]


# "owner/repo", optionally "@revision" and ":kernel_name": transformers' name of a Hub kernel.
_HUB_KERNEL = re.compile(r"^[^/:@]+/[^/:@]+(@[^/:@]+)?(:[^/:@]+)?$")


class UlyssesSPAttentionHF(nn.Module):
    """Ulysses around a transformers attention function ``attn`` (``forward`` has the
    registry's signature: ``(module, query, key, value, attention_mask, *args, **kwargs)``
    with ``[bs, heads, seq/P, head_size]`` tensors, returning ``([bs, seq/P, heads*head_size],
    weights)``).

    Raises:
        ValueError: head counts that cannot be split over the group (names them), a forward
            without ``position_ids``.
    """

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: comm.Group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        p = self.world_size
        if attn_head_count % p:
            raise ValueError(
                f"Attention head count {attn_head_count} is not divisible by SP size {p}: "
                f"choose a sequence_parallel_size that divides {attn_head_count}"
            )
        if kv_head_count % p and p % kv_head_count:
            raise ValueError(
                f"KV attention head count {kv_head_count} is not divisible by SP size {p} or "
                f"vice versa: choose a sequence_parallel_size that divides {kv_head_count} or "
                "is a multiple of it"
            )
        self.local_q_head_count = attn_head_count // p
        self.kv_replication_factor = p // kv_head_count
        self.local_kv_head_count = 1 if self.kv_replication_factor > 1 else kv_head_count // p
        self._exchange = ulysses_hf_attention(attn, process_group)

    def forward(  # type: ignore[override]
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        if kwargs.get("position_ids") is None:
            raise ValueError(
                "Ulysses SP requires position_ids in every forward() call: without them each "
                "rank numbers its shard from 0 and RoPE rotates the tokens wrongly. Put "
                "position_ids = arange(seq_len) in the batch before sharding "
                "(UlyssesSPDataLoaderAdapter requires them)"
            )
        fixed = self.local_seq_length if not self.seq_length_is_variable else None
        if fixed is not None and query.shape[2] != fixed:
            raise ValueError(
                f"query has {query.shape[2]} tokens per rank, the fixed local sequence "
                f"length is {self.local_seq_length}: register with "
                "seq_length_is_variable=True for batches of varying length"
            )
        out, weights = self._exchange(module, query, key, value, None, *args, **kwargs)
        return out.reshape(*out.shape[:2], -1), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> ModuleType | None:
        """Route ``core_attn_implementation`` (e.g. "sdpa") of transformers through Ulysses
        and return the sequence-parallel groups module (DeepSpeed's ``mpu``), or None when
        ``sequence_parallel_size`` is 1. As in DeepSpeed, the registry entry of that name is
        replaced in this process, so every model using it runs sequence-parallel. A Hub
        kernel name ("kernels-community/flash-attn2") is first loaded through transformers.

        Raises:
            ValueError: "eager" (it needs an O(S^2) mask), an unknown implementation, a
                model configured with another implementation, a fixed length without
                ``seq_length``, head counts that do not split.
        """
        if sequence_parallel_size == 1:
            return None
        if seq_length is None and max_length is not None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be "
                "set to the fixed sequence length"
            )
        from transformers import AutoConfig, PreTrainedModel
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        loaded = hasattr(model_name_or_path, "config") or isinstance(
            model_name_or_path, PreTrainedModel
        )
        config = (
            model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        )
        current = getattr(config, "_attn_implementation", None)
        if loaded and current is not None and current != core_attn_implementation:
            raise ValueError(  # DeepSpeed's wording: its tests match on it
                f"core_attn_implementation='{core_attn_implementation}' does not match "
                f"model config attn_implementation='{current}': set both to the same value"
            )
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(
                f"{core_attn_implementation} attn_implementation is not supported by Ulysses "
                "sequence parallelism (it needs a 4-D O(S^2) attention mask): use 'sdpa' or a "
                "flash attention variant"
            )
        if _HUB_KERNEL.match(core_attn_implementation):
            # A kernel from the Hub ("kernels-community/flash-attn2") enters the registry only
            # when transformers loads it, so load it before looking it up.
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

            lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{core_attn_implementation} is not a valid attn_implementation; the choices "
                f"are {ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        p = parallel_state_sp.get_sequence_parallel_world_size()
        text = config.get_text_config()
        heads = text.num_attention_heads
        uattn = cls(
            attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation],
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=parallel_state_sp.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable else seq_length // p,  # type: ignore[operator]
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
        )
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_wrapper(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, Any]:
            # The mask transformers built is the shard's: causality comes from the full
            # sequence after the exchange instead.
            return uattn(module, query, key, value, None, *args, **kwargs)  # type: ignore[no-any-return]

        ulysses_wrapper._slipstream_ulysses = True  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_wrapper
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter:
    """Wraps a dataloader of dict batches ``{input_ids, position_ids, labels, ...}``
    (``[bs, seq, ...]`` tensors) for Ulysses: the sp ranks share each rank's batch in turn, so
    P iterations consume one batch from every rank of the group, each rank getting its
    sequence shard of it. ``labels`` are replaced by ``shift_labels`` (shifted on the full
    sequence, -100 at the end) so the script computes the loss without losing shard edges.

    Raises:
        ValueError: a batch without ``position_ids``, tensors whose length differs from
            ``input_ids``', a length not divisible by ``sp_world_size``.
    """

    def __init__(
        self,
        dl: Iterable[dict[str, Any]],
        sp_rank: int,
        sp_group: comm.Group,
        sp_world_size: int,
        device: Any,
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter: Iterator[dict[str, Any]] = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather the next batch of every sp rank and keep this rank's shard of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses SP requires `position_ids` in every dataloader batch so that each "
                "token keeps its global position after sequence sharding: add position_ids "
                "= torch.arange(seq_len) per sample (reset at document boundaries when packed)"
            )
        length = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and value.shape[1] != length:
                raise ValueError(
                    f"{key}'s shape {tuple(value.shape)} must match input_ids's shape "
                    f"{tuple(batch['input_ids'].shape)}"
                )
        host = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        for full in comm.all_gather_object(host, group=self.sp_group):
            seq = full["input_ids"].shape[1]
            if seq % self.sp_world_size:
                raise ValueError(
                    f"batch's seqlen={seq} isn't divisible by sp-size={self.sp_world_size}"
                )
            chunk = seq // self.sp_world_size
            labels = full.pop("labels", None)
            if labels is not None:
                full["shift_labels"] = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            lo = chunk * self.sp_rank
            shard = {
                k: v[:, lo : lo + chunk].contiguous().to(self.device) if torch.is_tensor(v) else v
                for k, v in full.items()
            }
            self.micro_batches.append(shard)
