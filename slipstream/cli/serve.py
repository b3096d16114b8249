"""``slipstream serve MODEL``: an OpenAI-compatible HTTP server for a causal LM.

MODEL is what ``slipstream generate`` takes (a Hugging Face model directory, a reference GPT
directory, a ``.gguf`` file or ``smollm2``). Endpoints: ``/v1/completions``,
``/v1/chat/completions`` (streaming with ``"stream": true``), ``/v1/models``, ``/health``.
SIGTERM or Ctrl-C stops accepting connections, lets running requests finish (up to
``--shutdown-timeout`` seconds, then aborts them) and exits 0. Needs the ``serve`` extra
(``pip install 'slipstream[serve]'``: Starlette and uvicorn).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "pick_engine", "serve_command"]

ENGINES = ("continuous", "static")


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on the ``slipstream`` parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a causal LM over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("model", help="model directory (HF or slipstream GPT), .gguf file or 'smollm2'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--served-model-name", default=None,
        help="the model id clients send and /v1/models lists (default: MODEL's last part)",
    )  # fmt: skip
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument(
        "--engine", default="continuous", choices=ENGINES,
        help="continuous: the continuous-batching engine (paged KV cache); static: today's "
        "decode loop on static batches",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + answer tokens per request (default: the model's context)",
    )
    p.add_argument(
        "--max-pending", type=int, default=64,
        help="requests queued or running at most; more are answered 503 with Retry-After",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM/Ctrl-C",
    )
    p.add_argument("--cache-dir", default=None, help="where 'smollm2' is converted to")
    p.set_defaults(handler=serve_command)


def pick_engine(model: Any, kind: str, max_num_seqs: int, max_model_len: int | None) -> Any:
    """``(engine, name, sampling-params class)`` for ``--engine kind``: the continuous-batching
    engine (paged KV cache, the default) or the static-batching one; the caller logs which."""
    from slipstream.inference import ContinuousBatchingEngine
    from slipstream.inference.serving import SamplingParams, StaticBatchingEngine

    if kind == "static":
        engine = StaticBatchingEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        return engine, "static", SamplingParams
    engine = ContinuousBatchingEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return engine, "continuous", SamplingParams


def _run_until_signal(app: Any, args: argparse.Namespace) -> None:
    """Run uvicorn; SIGTERM/SIGINT stop it gracefully and the process exits 0.

    uvicorn re-raises the signal it caught once it has shut down (so that a default handler
    ends the process with it); a no-op handler installed here receives that instead."""
    import uvicorn

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )  # fmt: skip
    before = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def serve_command(args: argparse.Namespace) -> int:
    """Load the model, pick the engine, serve until SIGTERM/SIGINT."""
    import torch

    from slipstream._logging import logger
    from slipstream.config import ConfigError
    from slipstream.inference.pretrained import load_causal_lm

    try:
        from slipstream.inference.serving import ServeOptions, build_app
    except ImportError as err:
        print(f"slipstream serve: error: {err}; pip install 'slipstream[serve]'", file=sys.stderr)
        return 2
    try:
        model, tok = load_causal_lm(args.model, Path(args.cache_dir) if args.cache_dir else None)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        model = model.to(dtypes[args.dtype])
        engine, name, params_type = pick_engine(
            model, args.engine, args.max_num_seqs, args.max_model_len
        )
    except ConfigError as err:
        print(f"slipstream serve: error: {err}", file=sys.stderr)
        return 2
    served = args.served_model_name or Path(args.model.rstrip("/")).name
    options = ServeOptions(
        model_name=served, max_pending=args.max_pending, backend=name, params_type=params_type
    )
    logger.info(
        "serve: %s with the %s engine (%s) on http://%s:%d", served, name,
        type(engine).__name__, args.host, args.port,
    )  # fmt: skip
    _run_until_signal(build_app(engine, tok, options), args)
    logger.info("serve: stopped")
    return 0
