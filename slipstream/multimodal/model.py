"""The VisualChat model: frozen vision encoder -> trainable projection -> frozen causal LM
with multi-modal causal attention (DeepSpeed-VisualChat, arXiv 2309.14327, sec. 3; the
released ``modeling_dsvl.py`` assembles inputs the same way).

* Vision: slipstream's ViT encoder (:class:`~slipstream.models.vit.ViTSegmenter` without its
  decoder head), frozen: an image ``[C, H, W]`` becomes ``(H/P) * (W/P)`` tokens.
* Projection (trainable): Linear(vision width -> LM width) + LayerNorm(eps 1e-12), the
  paper's "baseline" projection.
* Language model: slipstream's GPT or a transformers LLaMA-family model, frozen, with its
  attention switched to MMCA; ``num_new_tokens`` trainable embedding rows for special tokens
  added after the LM was trained; optional LoRA on its linear layers (the released
  ``lang_lora_dim``), fused into the weights while generating as DeepSpeed-Chat's hybrid
  engine does.
* Assembly: every ``<image>`` placeholder id in ``input_ids`` is replaced by its image's
  projected tokens; the token-type vector marks text / image / pad; labels are -100 on image
  tokens; the assembled length is padded to a multiple of 8 (within the LM's context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.inference.hf import make_cache
from slipstream.inference.sampling import SamplingPolicy, next_tokens
from slipstream.models.lora import LoRALinear, apply_lora_, fused_lora
from slipstream.models.vit import ViTSegmenter
from slipstream.multimodal.attention import IMAGE, PAD, TEXT, MMCAMode
from slipstream.multimodal.lm import ExtendedEmbedding, GPTDecoder, make_decoder

__all__ = ["LM_LORA_TARGETS", "Assembled", "VisionEncoder", "VisualChat", "VisualChatConfig"]

LM_LORA_TARGETS = (r"\.(q|k|v|o)_proj$", r"\.(gate|up|down)_proj$")
"""Attention and MLP projections of LLaMA-family models and slipstream's GPT."""


@dataclass(frozen=True)
class VisualChatConfig:
    """How VisualChat assembles and attends. Validated at construction."""

    image_token_id: int
    """The ``<image>`` placeholder id in ``input_ids`` (replaced, never embedded)."""
    image_size: int
    """Height and width of the (square) input images, in pixels."""
    num_new_tokens: int = 0
    """Special tokens added after the LM's vocabulary: ids ``V .. V + n - 1``, trainable rows."""
    mmca_mode: MMCAMode = "paper"
    """Attention: "paper" MMCA, "reference_code" (the released arithmetic) or "causal"."""
    pad_multiple: int = 8
    """The assembled length is padded up to a multiple of this (capped at the context)."""
    projection_eps: float = 1e-12
    """LayerNorm epsilon of the projection (the released code's value)."""
    lm_lora_rank: int = 0
    """LoRA rank on the LM's linear layers (the released ``lang_lora_dim``); 0 = no LoRA."""
    lm_lora_alpha: float | None = None
    """LoRA scale numerator: the update is scaled by ``alpha / rank`` (default: the rank)."""
    lm_lora_targets: tuple[str, ...] = LM_LORA_TARGETS
    """Patterns (``re.search``) of the LM's linear layers that get LoRA."""

    def __post_init__(self) -> None:
        for name in ("image_size", "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"VisualChatConfig.{name}={getattr(self, name)} must be >= 1")
        if self.lm_lora_rank < 0:
            raise ValueError(
                f"VisualChatConfig.lm_lora_rank={self.lm_lora_rank} must be >= 0 (0 = no LoRA)"
            )
        if self.num_new_tokens < 0:
            raise ValueError(f"VisualChatConfig.num_new_tokens={self.num_new_tokens} must be >= 0")
        if self.mmca_mode not in ("paper", "reference_code", "causal"):
            raise ValueError(
                f"VisualChatConfig.mmca_mode={self.mmca_mode!r} is unknown; use 'paper', "
                "'reference_code' or 'causal'"
            )


class VisionEncoder(nn.Module):
    """A ViT encoder over whole images: ``[N, C, S, S]`` -> ``[N, (S/P)^2, d]``."""

    def __init__(self, vit: ViTSegmenter, image_size: int) -> None:
        super().__init__()
        cfg = vit.config
        if image_size % cfg.patch_size:
            raise ValueError(
                f"VisualChat: image_size={image_size} is not a multiple of the ViT's "
                f"patch_size={cfg.patch_size}"
            )
        self.vit, self.image_size = vit, image_size
        self.num_tokens = (image_size // cfg.patch_size) ** 2
        if self.num_tokens > cfg.max_tokens:
            raise ValueError(
                f"VisualChat: {self.num_tokens} patches per image exceed the ViT's "
                f"max_tokens={cfg.max_tokens}"
            )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, c, s, p = images.shape[0], images.shape[1], self.image_size, self.vit.config.patch_size
        g = s // p
        tokens = images.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        x = self.vit.embed(tokens.reshape(n, g * g, c, p, p))
        for block in self.vit.blocks:
            x = block(x, None)
        return self.vit.norm(x)  # type: ignore[no-any-return]


@dataclass
class Assembled:
    """A batch after placeholder replacement: ``embeds [B, L, d]``, ``token_types [B, L]``,
    ``position_ids [B, L]`` and ``labels [B, L]`` (None without labels)."""

    embeds: torch.Tensor
    token_types: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None


def _name(sample_ids: list[str] | None, row: int) -> str:
    return f"sample {sample_ids[row]!r}" if sample_ids is not None else f"batch row {row}"


class VisualChat(nn.Module):
    """Frozen vision encoder + trainable projection + frozen causal LM with MMCA (module doc).

    Only ``projection``, ``embed.new_rows`` and the LM's LoRA adapters (with
    ``config.lm_lora_rank``) require gradients; pass
    ``[p for p in model.parameters() if p.requires_grad]`` to the optimizer (``slipstream.
    initialize`` then keeps no optimizer state for the frozen parts).
    """

    def __init__(self, vision: ViTSegmenter, lm: nn.Module, config: VisualChatConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(vision, config.image_size).requires_grad_(False)
        self.lm = lm.requires_grad_(False)
        if config.lm_lora_rank:
            apply_lora_(lm, config.lm_lora_targets, config.lm_lora_rank, config.lm_lora_alpha)
        self.decoder = make_decoder(lm, config.mmca_mode)
        self.embed = ExtendedEmbedding(self.decoder.input_embedding(), config.num_new_tokens)
        width = self.decoder.hidden_size
        self.projection = nn.Sequential(
            nn.Linear(vision.config.hidden_size, width),
            nn.LayerNorm(width, eps=config.projection_eps),
        )

    def train(self, mode: bool = True) -> VisualChat:
        """Train the projection; the frozen encoder stays in eval mode (no dropout)."""
        super().train(mode)
        self.vision.eval()
        return self

    def _check_images(
        self, images: torch.Tensor, counts: torch.Tensor, ids: list[str] | None
    ) -> None:
        c, s = self.vision.vit.config.in_channels, self.config.image_size
        if images.dim() == 4 and tuple(images.shape[1:]) == (c, s, s):
            return
        row = int((counts > 0).nonzero()[0, 0])
        raise ValueError(
            f"VisualChat: images must be [N, {c}, {s}, {s}] (channels, size of the vision "
            f"encoder); got {tuple(images.shape)} (first image of {_name(ids, row)}); resize or "
            "convert the images, or build the model for this size"
        )

    def _check_counts(
        self, found: torch.Tensor, counts: torch.Tensor, ids: list[str] | None
    ) -> None:
        bad = (found != counts).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise ValueError(
                f"VisualChat: {_name(ids, row)} has {int(found[row])} <image> placeholders but "
                f"{int(counts[row])} images; every image needs exactly one placeholder"
            )

    def assemble(
        self,
        input_ids: torch.Tensor,
        images: torch.Tensor,
        image_counts: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
        left_pad: bool = False,
    ) -> Assembled:
        """Replace each placeholder by its image's projected tokens (module doc).

        Args:
            input_ids: ``[B, T]`` text ids with ``image_token_id`` placeholders.
            images: ``[N, C, S, S]``, the images of all rows in order (row 0's first).
            image_counts: ``[B]`` images per row.
            attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (default all real).
            labels: ``[B, T]`` targets aligned with ``input_ids``, -100 where no loss.
            sample_ids: names of the rows, for error messages.
            left_pad: right-align the rows (for generation) instead of left-aligning them.

        Raises:
            ValueError: placeholder/image count mismatch, a wrong image shape, or a row
                longer than the LM's context; the message names the sample.
        """
        b, t = input_ids.shape
        mask = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.bool()
        )
        placeholders = (input_ids == self.config.image_token_id) & mask
        counts = image_counts.to(input_ids.device)
        self._check_counts(placeholders.sum(1), counts, sample_ids)
        per_image = self.vision.num_tokens
        rep = torch.where(placeholders, per_image, 1).flatten()
        lengths = rep.view(b, t).sum(1)
        out_len = self._padded_length(lengths, sample_ids)
        src = torch.repeat_interleave(torch.arange(b * t, device=input_ids.device), rep)
        is_image = placeholders.flatten()[src]
        tokens = self.embed(input_ids.masked_fill(placeholders | ~mask, 0)).flatten(0, 1)[src]
        if int(counts.sum()):
            self._check_images(images, counts, sample_ids)
            feats = self.projection(self.vision(images.to(tokens.dtype))).to(tokens.dtype)
            tokens = tokens.masked_scatter(
                is_image.unsqueeze(-1), feats.reshape(-1, tokens.shape[-1])
            )
        types = torch.where(is_image, IMAGE, torch.where(mask.flatten()[src], TEXT, PAD))
        row = src // t
        starts = torch.cumsum(lengths, 0) - lengths
        offset = (out_len - lengths) if left_pad else torch.zeros_like(lengths)
        dest = (
            row * out_len + offset[row] + torch.arange(src.numel(), device=src.device) - starts[row]
        )
        embeds = tokens.new_zeros(b * out_len, tokens.shape[-1]).index_copy(0, dest, tokens)
        out_types = types.new_zeros(b * out_len).index_copy(0, dest, types).view(b, out_len)
        out_labels = None
        if labels is not None:
            flat = torch.where(is_image, -100, labels.flatten()[src])
            out_labels = (
                flat.new_full((b * out_len,), -100).index_copy(0, dest, flat).view(b, out_len)
            )
        positions = ((out_types != PAD).cumsum(1) - 1).clamp(min=0)
        return Assembled(embeds.view(b, out_len, -1), out_types, positions, out_labels)

    def _padded_length(self, lengths: torch.Tensor, sample_ids: list[str] | None) -> int:
        context = self.decoder.context_length
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > context:
            row = int(lengths.argmax())
            raise ValueError(
                f"VisualChat: {_name(sample_ids, row)} is {longest} tokens after image "
                f"expansion, longer than the language model's context of {context}; drop "
                "images or turns from it, or use a model with a longer context"
            )
        m = self.config.pad_multiple
        return min(-(-longest // m) * m, context)

    def forward(
        self,
        input_ids: torch.Tensor,
        images: torch.Tensor,
        image_counts: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over the answer tokens (fp32) when ``labels`` is
        given, else logits ``[B, L, V]`` over the assembled sequence (see :meth:`assemble`)."""
        a = self.assemble(input_ids, images, image_counts, attention_mask, labels, sample_ids)
        logits = self.decoder.logits(a.embeds, a.token_types, a.position_ids)
        if a.labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            a.labels[:, 1:].reshape(-1),
            ignore_index=-100,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        images: torch.Tensor,
        image_counts: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        sampling: SamplingPolicy | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue each conversation by up to ``max_new_tokens`` text tokens ``[B, n]``.

        A transformers LM decodes against its KV cache (new tokens are text queries over the
        cached keys, with their token types appended); slipstream's GPT recomputes the context
        each step (its KV-cache path does not run the MMCA cores). Rows that emitted ``eos_token_id`` repeat it.
        """
        args = (input_ids, images, image_counts, max_new_tokens, attention_mask, eos_token_id)
        if not any(isinstance(m, LoRALinear) for m in self.lm.modules()):
            return self._generate(*args, sampling, generator)
        with fused_lora(self.lm):  # one GEMM per layer while decoding, as the hybrid engine
            return self._generate(*args, sampling, generator)

    def _generate(
        self,
        input_ids: torch.Tensor,
        images: torch.Tensor,
        image_counts: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None,
        eos_token_id: int | None,
        sampling: SamplingPolicy | None,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        policy = sampling or SamplingPolicy()
        a = self.assemble(input_ids, images, image_counts, attention_mask, left_pad=True)
        embeds, types, positions = a.embeds, a.token_types, a.position_ids
        cache: Any = (
            None if isinstance(self.decoder, GPTDecoder) else make_cache(self.lm, "dynamic", 0)
        )
        logits = self.decoder.logits(embeds, types, positions, cache)[:, -1]
        out: list[torch.Tensor] = []
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            token = next_tokens(logits, policy, generator=generator)
            if eos_token_id is not None:
                token = torch.where(done, eos_token_id, token)
                done |= token == eos_token_id
            out.append(token)
            if bool(done.all()) or len(out) == max_new_tokens:
                break
            new = self.embed(token[:, None])
            types = torch.cat([types, torch.full_like(types[:, :1], TEXT)], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
            if cache is None:
                embeds = torch.cat([embeds, new], 1)
                logits = self.decoder.logits(embeds, types, positions)[:, -1]
            else:
                logits = self.decoder.logits(new, types, positions[:, -1:], cache)[:, -1]
        return torch.stack(out, 1) if out else input_ids.new_zeros(input_ids.shape[0], 0)
