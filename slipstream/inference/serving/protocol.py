"""What the server needs from a generation engine: a request-level, step-driven interface.

The HTTP server (``app.py``) drives any object with these methods from one engine thread:
requests are added and aborted between steps, and each :meth:`GenerationEngine.step` returns
the tokens every running request produced in it. Two engines implement it: the continuous
batching engine (``slipstream.inference.ContinuousBatchingEngine``: a paged KV cache, new
requests join at every step) and :class:`~slipstream.inference.serving.static.StaticBatchingEngine`
(today's decode loop run on small static batches).

:class:`SamplingParams` and :class:`RequestOutput` are the request types of both engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["GenerationEngine", "RequestOutput", "SamplingParams"]


@dataclass
class SamplingParams:
    """How one request is decoded."""

    max_new_tokens: int = 16
    """Tokens to generate at most (EOS or a stop token may end the request earlier)."""
    temperature: float = 1.0
    """Logits are divided by it before top-k/top-p (sampling only)."""
    top_k: int | None = None
    """Keep the k most likely tokens (None: all)."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches it (None: all)."""
    do_sample: bool = False
    """Draw the next token; False picks the argmax (greedy)."""
    seed: int | None = None
    """Seed of the request's own random stream (None: the process's)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request besides the model's EOS tokens."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens (stop tokens still end it)."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    """Tokens generated in this step (the ending EOS or stop token included)."""
    finished: bool
    finish_reason: str | None
    """``"stop"`` (EOS or a stop token), ``"length"`` (``max_new_tokens``) or ``"abort"``."""


class GenerationEngine(Protocol):
    """A step-driven engine the server can serve. Not thread-safe: one thread calls it."""

    max_model_len: int
    """Prompt plus new tokens of one request, at most."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end a request unless it sets ``ignore_eos``."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError for a prompt too long or a duplicate id."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free what it holds; unknown ids are ignored."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one forward over the running requests; what each produced."""
        ...

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running."""
        ...

    def free_blocks(self) -> int:
        """KV-cache blocks (for the static engine: batch slots) free now."""
        ...

    def total_blocks(self) -> int:
        """KV-cache blocks (batch slots) in all."""
        ...
