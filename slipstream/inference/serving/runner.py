"""One thread drives the engine; each request reads its tokens from an asyncio queue.

The engine is not thread-safe and its ``step()`` blocks for a model forward, so it runs on a
thread of its own: it takes the requests added and aborted since the last step, runs one
step, and hands each request's new tokens to the event loop (``call_soon_threadsafe``), where
the HTTP handler of that request awaits them on its own :class:`asyncio.Queue`. New requests
therefore join between two steps, which is what continuous batching needs.

Admission is bounded: at most ``max_pending`` requests are queued or running; past that
:meth:`EngineRunner.submit` raises :class:`Overloaded` at once (the server answers 503 with
``Retry-After``) instead of letting a queue grow without bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any

from slipstream._logging import logger
from slipstream.inference.serving.protocol import GenerationEngine, RequestOutput

__all__ = ["EngineFailure", "EngineRunner", "EngineStats", "Overloaded"]


class Overloaded(RuntimeError):
    """``max_pending`` requests are already queued or running."""


@dataclass(frozen=True)
class EngineFailure:
    """Put on a request's queue instead of a :class:`RequestOutput` when it cannot go on."""

    message: str
    status: int
    """The HTTP status it maps to: 400 (the engine refused the request), 500 (the engine
    failed), 503 (the server is shutting down)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken on the engine thread after each step (read by ``/health``)."""

    pending: int
    free_blocks: int
    total_blocks: int
    steps: int


class EngineRunner:
    """Runs ``engine`` on a daemon thread (see the module docstring).

    Args:
        engine: the engine to drive; only the runner's thread touches it after :meth:`start`.
        max_pending: requests queued or running at most (>= 1).
    """

    def __init__(self, engine: GenerationEngine, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}; use >= 1")
        self.engine = engine
        self.max_pending = max_pending
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineFailure]] = {}
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[str, str, Any, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._steps = 0
        self.stats = EngineStats(0, engine.free_blocks(), engine.total_blocks(), 0)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request still queued or running (its handler gets a 503 failure) and
        join the thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(
        self, request_id: str, prompt_ids: list[int], params: Any
    ) -> asyncio.Queue[RequestOutput | EngineFailure]:
        """Queue a request; its outputs arrive on the returned queue, ending with a finished
        :class:`RequestOutput` or an :class:`EngineFailure`.

        Raises:
            Overloaded: ``max_pending`` requests are queued or running, or the server stops.
        """
        outputs: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        with self._lock:
            if self._stopping.is_set() or len(self._queues) >= self.max_pending:
                raise Overloaded(f"{len(self._queues)} requests are queued or running")
            self._queues[request_id] = outputs
        self._commands.put(("add", request_id, prompt_ids, params))
        self._wake.set()
        return outputs

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed before the next step."""
        with self._lock:
            if self._queues.pop(request_id, None) is None:
                return
        self._commands.put(("abort", request_id, None, None))
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | EngineFailure) -> None:
        with self._lock:
            target = self._queues.get(request_id)
            ends = isinstance(item, EngineFailure) or item.finished
            if target is not None and ends:
                del self._queues[request_id]
        if target is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(target.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, prompt_ids, params = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(request_id)
                continue
            with self._lock:
                alive = request_id in self._queues
            if not alive:  # aborted before it reached the engine
                continue
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except ValueError as err:
                self._deliver(request_id, EngineFailure(str(err), 400))

    def _fail_all(self, message: str, status: int) -> None:
        with self._lock:
            ids = list(self._queues)
        for request_id in ids:
            self.engine.abort(request_id)
            self._deliver(request_id, EngineFailure(message, status))

    def _snapshot(self) -> None:
        with self._lock:
            pending = len(self._queues)
        engine = self.engine
        self.stats = EngineStats(pending, engine.free_blocks(), engine.total_blocks(), self._steps)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._snapshot()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # one bad step must not take the server down
                logger.exception("serve: the engine's step failed; failing its requests")
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}", 500)
                continue
            self._steps += 1
            for out in outputs:
                self._deliver(out.request_id, out)
            self._snapshot()
        self._apply_commands()
        self._fail_all("the server is shutting down", 503)
        self._snapshot()
