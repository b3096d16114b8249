"""The decode step of a Hugging Face causal LM as one CUDA graph (``enable_cuda_graph``).

A small model decoding a few rows is bound by kernel launches, not arithmetic: SmolLM2-135M
on an H200 spends about 17 ms a token launching the kernels of 30 layers from Python, for a
fraction of that in GPU work (docs/inference.md). Replaying a captured graph launches them
all at once.

A graph replays fixed kernels on fixed addresses, so every input of the step lives in a
buffer allocated once and written in place between replays:

- the token ids ``[b, 1]`` and position ids ``[b, 1]``;
- the attention mask as an additive ``[b, 1, 1, max_len]`` tensor (0 where a key may be
  attended, the dtype's minimum elsewhere), which Hugging Face models take as it is. Columns
  past the current length stay masked, so the same mask tensor serves every step;
- the keys and values in a ``transformers.StaticCache`` preallocated for ``max_len``
  tokens, whose layers advance their write position with an on-device counter (recorded in
  the graph, so each replay writes the next slot); ``cache_position`` as a buffer too where
  the model's forward takes it.

The prompt runs eagerly (its length varies). The first decode step runs eagerly too, which
sets up the libraries' workspaces; the second is captured and replayed, and every later
step only replays. Rows cannot leave the batch (the graph's shapes are fixed): finished rows
keep decoding the pad token, as Hugging Face ``generate`` does.

With ``capture=False`` the same buffers and calls run eagerly: that is how the CPU tests
check the static path gives Hugging Face's tokens.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.inference import hf

__all__ = ["GraphedDecoder"]


@cache
def _takes_cache_position(model_cls: Any) -> bool:
    return "cache_position" in inspect.signature(model_cls.forward).parameters


class GraphedDecoder:
    """A static KV cache and the buffers of one decode step; replays it as a CUDA graph.

    Made per ``generate`` call by :func:`make` (the generation loop's ``make_cache`` for the
    ``"graph"`` kind) and driven through :func:`last_logits`.
    """

    def __init__(self, model: nn.Module, max_len: int, capture: bool) -> None:
        self.model = model
        self.max_len = max_len
        self.capture = capture
        self.cache = hf.make_cache(model, "static", max_len)
        self.graph: Any = None
        self.steps = 0  # decode steps run so far
        self.ids: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _buffers(self, tokens: torch.Tensor, dtype: torch.dtype) -> None:
        b, device = tokens.shape[0], tokens.device
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.blocked = torch.finfo(dtype).min
        self.mask = torch.full((b, 1, 1, self.max_len), self.blocked, dtype=dtype, device=device)

    def _forward(self) -> torch.Tensor:
        model_cls: Any = type(self.model)
        kwargs: dict[str, Any] = {
            "input_ids": self.ids,
            "attention_mask": self.mask,
            "position_ids": self.positions,
            hf.cache_argument(model_cls): self.cache,
            "use_cache": True,
        }
        keep = hf.keep_argument(model_cls)
        if keep is not None:
            kwargs[keep] = 1
        if _takes_cache_position(model_cls):
            kwargs["cache_position"] = self.cache_position
        out = self.model(**kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -1]

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The prompt, eagerly, into the static cache; the last position's logits."""
        logits = hf.last_logits(self.model, ids, mask, positions, self.cache)
        # The additive mask meets the attention scores: the model's dtype, not the logits'
        # (which some models upcast to fp32).
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        self._buffers(ids, dtype or torch.float32)
        return logits

    def decode(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        """One token per row: ``tokens [b, 1]``, ``mask [b, length]`` (2-D, the new token's
        column included), ``positions [b, 1]``; the logits ``[b, vocab]``."""
        assert self.ids is not None, "prefill first"
        length = mask.shape[1]
        if length > self.max_len:
            raise ValueError(f"decode step {length} past the static cache ({self.max_len})")
        self.ids.copy_(tokens)
        self.positions.copy_(positions)
        self.cache_position.fill_(length - 1)
        keep = mask.to(torch.bool)[:, None, None, :]
        self.mask[..., :length].copy_(torch.where(keep, 0.0, self.blocked))
        self.steps += 1
        if not self.capture:
            return self._forward()
        accel = get_accelerator()
        if self.steps == 1:  # eagerly, on a side stream: the libraries set up outside capture
            side = accel.Stream()
            side.wait_stream(accel.current_stream())
            with accel.stream(side):
                logits = self._forward()
            accel.current_stream().wait_stream(side)
            return logits
        if self.graph is None:
            accel.synchronize()
            self.graph = accel.create_graph()
            with accel.capture_to_graph(self.graph):
                self.logits = self._forward()
        accel.replay_graph(self.graph)
        return self.logits


def make(model: nn.Module, max_len: int) -> GraphedDecoder:
    """A :class:`GraphedDecoder` for ``model``; it captures a graph only on CUDA."""
    device = next(model.parameters()).device
    return GraphedDecoder(model, max_len, capture=device.type == "cuda")


def last_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    decoder: GraphedDecoder,
) -> Any:
    """The generation driver's step: the prompt eagerly, then one token per row."""
    if decoder.ids is None:
        return decoder.prefill(input_ids, attention_mask, position_ids)
    return decoder.decode(input_ids, attention_mask, position_ids)


def select_rows(decoder: GraphedDecoder, rows: torch.Tensor) -> None:
    raise RuntimeError(
        "a CUDA-graph decode step has a fixed batch: finished rows stay in it "
        "(finished_rows='mask'); the engine sets this with enable_cuda_graph"
    )
