"""Serving throughput on a ragged request trace: static batching, HF ``generate`` in batches and
the continuous-batching engine, same model, same trace, same greedy tokens.

    .venv/bin/python benchmarks/serve.py                 # the full trace
    .venv/bin/python benchmarks/serve.py --quick         # a smoke run (seconds)
    .venv/bin/python benchmarks/serve.py --requests 128 --rate 8 --batch 16 --model DIR
    .venv/bin/python benchmarks/serve.py --repeats 5     # medians and spread of 5 replays

The trace is seeded (``--seed``): ``--requests`` requests arriving as a Poisson process at
``--rate`` requests/s (``inf``: all at once), prompt and answer lengths drawn log-uniformly
between the ``--prompt-len`` and ``--answer-len`` bounds, so a few long requests sit among
many short ones (the case static batching handles worst). Answers are greedy with EOS
ignored, so every engine produces exactly the requested number of tokens and the outputs can
be compared token for token.

Rows:

* ``static``: slipstream's decode loop on static batches
  (:class:`~slipstream.inference.serving.StaticBatchingEngine`, ``--batch`` rows): a batch is
  formed from the requests that have arrived when the previous one ends, runs until its
  longest answer is done, finished rows dropped but never replaced.
* ``hf-generate``: Hugging Face ``model.generate`` on the same batches (padding left, every
  row runs to the batch's longest answer; tokens past a request's own length are discarded).
* ``continuous``: ``slipstream.inference.ContinuousBatchingEngine`` (paged KV cache, requests
  join at every step, chunked prefill), when this install has it; otherwise the row says so.

Each row replays the trace in real time (a request is handed to the engine only once its
arrival time has passed). Reported: generated tokens/s over the makespan (first arrival to last
token), and per-token latency p50/p99: for every generated token, the time since the previous
token of its request (for the first token: since the request arrived, so queueing counts).
Ratios are against ``static``. Timings on a shared machine move with its load (printed);
compare ratios from one run. ``--repeats N`` replays the trace N times, the rows round-robin
(static, HF, continuous, then again), and reports each row's median tokens/s, its spread
(min-max over the replays), the median of the per-replay ratios to ``static`` and the
median p50/p99 latencies; the tokens of every replay must equal the first static replay's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.inference import ContinuousBatchingEngine
from slipstream.inference.serving import SamplingParams, StaticBatchingEngine


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival: float
    prompt: list[int]
    new_tokens: int


@dataclass
class Result:
    name: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    makespan: float = 0.0
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        total = sum(len(t) for t in self.tokens.values())
        return total / self.makespan if self.makespan > 0 else float("nan")

    def latency_ms(self, q: float) -> float:
        if not self.gaps:
            return float("nan")
        ordered = sorted(self.gaps)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_trace(args: argparse.Namespace, vocab: int) -> list[Request]:
    """The seeded trace (see the module docstring)."""
    g = torch.Generator().manual_seed(args.seed)

    def log_uniform(lo: int, hi: int) -> int:
        u = float(torch.rand((), generator=g))
        return round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))

    t, trace = 0.0, []
    for i in range(args.requests):
        if args.rate != math.inf:
            t += float(torch.empty(()).exponential_(args.rate, generator=g))
        n = log_uniform(*args.prompt_len)
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()
        trace.append(Request(f"r{i}", t, prompt, log_uniform(*args.answer_len)))
    return trace


def _wait_until(start: float, t: float) -> None:
    delay = start + t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(name: str, engine: Any, trace: list[Request], params_type: Any) -> Result:
    """Replay ``trace`` on a step-driven engine (the serving interface)."""
    result = Result(name, {r.request_id: [] for r in trace})
    last: dict[str, float] = {}
    start = time.perf_counter()
    i = 0
    while i < len(trace) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(trace) and trace[i].arrival <= now:
            req = trace[i]
            params = params_type(max_new_tokens=req.new_tokens, ignore_eos=True)
            engine.add_request(req.request_id, req.prompt, params)
            last[req.request_id] = req.arrival
            i += 1
        if not engine.has_unfinished():
            _wait_until(start, trace[i].arrival)
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            for token in out.new_token_ids:
                result.tokens[out.request_id].append(token)
                result.gaps.append(stamp - last[out.request_id])
                last[out.request_id] = stamp
    result.makespan = time.perf_counter() - start - trace[0].arrival
    return result


class _StepClock:
    """A logits processor that only records when each decode step ran."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def run_hf(model: Any, trace: list[Request], batch: int, pad: int) -> Result:
    """Replay ``trace`` with ``model.generate`` on batches formed as the static engine forms
    them (FIFO, up to ``batch`` arrived requests when the previous batch ends)."""
    from transformers import LogitsProcessorList

    result = Result("hf-generate", {r.request_id: [] for r in trace})
    start = time.perf_counter()
    i = 0
    while i < len(trace):
        _wait_until(start, trace[i].arrival)
        now = time.perf_counter() - start
        rows = [r for r in trace[i:] if r.arrival <= now][:batch]
        i += len(rows)
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[j, width - len(r.prompt) :] = 1
        clock = _StepClock()
        new = max(r.new_tokens for r in rows)
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # EOS ignored, as the engines are told
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                    pad_token_id=pad, logits_processor=LogitsProcessorList([clock]),
                )  # fmt: skip
        finally:
            model.generation_config.eos_token_id = saved
        stamps = [s - start for s in clock.stamps]
        for j, r in enumerate(rows):
            result.tokens[r.request_id] = out[j, width : width + r.new_tokens].tolist()
            prev = r.arrival
            for s in stamps[: r.new_tokens]:
                result.gaps.append(s - prev)
                prev = s
    result.makespan = time.perf_counter() - start - trace[0].arrival
    return result


def load_model(args: argparse.Namespace) -> tuple[Any, str]:
    if args.model:
        from slipstream.inference.pretrained import load_causal_lm

        model, _ = load_causal_lm(args.model)
        return model.eval(), args.model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, layers = (64, 2) if args.quick else (args.hidden, args.layers)
    cfg = LlamaConfig(
        vocab_size=1024 if args.quick else 8192, hidden_size=hidden,
        intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=2048, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters()) / 1e6
    return model, f"random-weight LLaMA {layers}x{hidden} ({n:.1f}M params)"


def compare(reference: Result, other: Result) -> str:
    """How many requests got ``reference``'s tokens exactly."""
    same = sum(other.tokens[k] == v for k, v in reference.tokens.items())
    return f"{same}/{len(reference.tokens)}"


def run(args: argparse.Namespace) -> list[Result]:
    """Every row on one model and trace; prints the table; returns the results."""
    torch.set_num_threads(args.threads)
    model, described = load_model(args)
    vocab = int(model.config.vocab_size)
    pad = int(model.config.pad_token_id or 0)
    trace = make_trace(args, vocab)
    total = sum(r.new_tokens for r in trace)
    print(f"model: {described}; {len(trace)} requests, {total} answer tokens, rate "
          f"{args.rate} req/s, batch {args.batch}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    replays: list[list[Result]] = []
    for _ in range(args.repeats):
        static = StaticBatchingEngine(model, max_num_seqs=args.batch)
        results = [run_engine("static", static, trace, SamplingParams)]
        results.append(run_hf(model, trace, args.batch, pad))
        engine = ContinuousBatchingEngine(model, max_num_seqs=args.max_num_seqs)
        results.append(run_engine("continuous", engine, trace, SamplingParams))
        replays.append(results)
    if args.repeats == 1:
        print(format_table(replays[0]))
    else:
        print(format_repeats(replays))
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return replays[0]


def format_repeats(replays: list[list[Result]]) -> str:
    """Medians and spread over the replays (tokens checked against the first static)."""
    first = replays[0][0]
    lines = [f"{len(replays)} replays: medians (min-max)",
             f"{'engine':<12} {'tokens/s':>22} {'x static':>9} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'same tokens as static':>22}"]  # fmt: skip
    for i, row in enumerate(replays[0]):
        runs = [results[i] for results in replays]
        if any(r.error for r in runs):
            lines.append(f"{row.name:<12} {next(r.error for r in runs if r.error)}")
            continue
        tps = [r.tokens_per_s for r in runs]
        ratio = statistics.median(r.tokens_per_s / rs[0].tokens_per_s
                                  for r, rs in zip(runs, replays, strict=True))  # fmt: skip
        same = min((compare(first, r) for r in runs), key=lambda s: int(s.split("/")[0]))
        spread = f"{statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})"
        lines.append(
            f"{row.name:<12} {spread:>22} {ratio:>8.2f}x "
            f"{statistics.median(r.latency_ms(0.5) for r in runs):>8.1f} "
            f"{statistics.median(r.latency_ms(0.99) for r in runs):>8.1f} {same:>22}"
        )
    return "\n".join(lines)


def format_table(results: list[Result]) -> str:
    base = results[0]
    lines = [f"{'engine':<12} {'tokens/s':>9} {'x static':>9} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'same tokens as static':>22}"]  # fmt: skip
    for r in results:
        if r.error:
            lines.append(f"{r.name:<12} {r.error}")
            continue
        ratio = r.tokens_per_s / base.tokens_per_s
        lines.append(
            f"{r.name:<12} {r.tokens_per_s:>9.1f} {ratio:>8.2f}x {r.latency_ms(0.5):>8.1f} "
            f"{r.latency_ms(0.99):>8.1f} {compare(base, r):>22}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="tiny model, 8 short requests")
    p.add_argument("--model", default=None, help="an HF causal-LM directory (or smollm2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=16.0, help="arrivals per second (inf: at once)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    p.add_argument("--answer-len", type=int, nargs=2, default=(4, 256), metavar=("MIN", "MAX"))
    p.add_argument("--batch", type=int, default=16, help="static and HF batch size")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the continuous engine's")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="replays of the trace (rows round-robin): medians and spread")  # fmt: skip
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be >= 1")
    if args.quick:
        args.requests, args.prompt_len, args.answer_len = 8, (2, 12), (2, 12)
        args.rate, args.batch, args.threads = math.inf, 4, 1
    return args


if __name__ == "__main__":
    run(parse_args())
