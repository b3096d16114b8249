"""A whole :class:`~slipstream.models.decoding.GenerationRequest` (a left-padded batch)
through the continuous-batching engine, returned in the static engine's format.

The RLHF rollouts (the hybrid engine's ``engine.generate``, and through it PPO and GRPO)
use it: every row is one request of a :class:`ContinuousBatchingEngine`, so a row that ends
early frees its blocks and stops costing compute, a padded prompt costs only its real tokens,
and the ``num_return_sequences`` / group copies of one prompt compute and store the prompt
once (shared prompt blocks).

Tokens: greedy rows are the static engine's (the paged forward differs from it by fp
rounding only). Sampled rows draw from one generator per row, seeded from the request's
generator (or the global RNG) before decoding starts, so they are reproducible for a seed and
independent of how rows are batched, but they are not the draws of the static engine's single
batch-wide generator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference import generation
from slipstream.inference.batching import ContinuousBatchingEngine
from slipstream.inference.paged_models import Gather, Runner, runner_for
from slipstream.models.decoding import FinishedRows, GenerationRequest, RankSync

__all__ = ["generate_auto", "paged_refusal", "run_paged"]


def paged_refusal(model: nn.Module, req: GenerationRequest) -> str | None:
    """Why ``req`` cannot run on the paged engine (None: it can)."""
    if req.stop_strings:
        return "stop_strings need the text decoded every step"
    if req.streamer is not None:
        return "a streamer takes the whole batch step by step"
    if model.training:
        return "the model is in training mode (the paged forward applies no attention dropout)"
    try:
        runner_for(model, fuse=False)  # the refusal only: no weights packed
    except ConfigError as e:
        return str(e)
    return None


def generate_auto(
    model: nn.Module,
    req: GenerationRequest,
    *,
    cache: generation.CacheChoice,
    finished: FinishedRows,
    sync: RankSync,
    runner: Callable[[], Runner] | None = None,
    tensor_parallel: bool = False,
) -> torch.Tensor:
    """``init_inference(...).generate``'s choice: with ``cache`` "auto" or "paged", greedy
    requests with finished rows dropped run here (``runner`` returns the model's paged
    forward to reuse, called only then), on one process or on a tensor-parallel group
    (``tensor_parallel``: ``sync`` is the group's :class:`TPRankSync`, whose ranks then run
    the same schedule and take TP rank 0's tokens each step); the rest, and every other
    ``cache``, run the static loop (``generation.run``).

    Sampled requests stay on the static loop: its draws are Hugging Face ``generate``'s
    (one batch-wide stream, global RNG or the request's generator), which per-row
    generators cannot reproduce (docs/inference.md).

    Raises:
        ConfigError: ``cache="paged"`` and a request this engine cannot run, naming why.
    """
    if cache in ("auto", "paged"):
        why: str | None
        if req.sampling.do_sample:
            why = "sampled rows keep the static engine's batch-wide generator draws"
        elif finished != "drop":
            why = f"finished_rows={finished!r} keeps finished rows in the batch"
        elif type(sync) is not RankSync and not tensor_parallel:  # the base: one process
            why = "expert-parallel processes generate in lock-step"
        elif cache == "auto" and not _paged_measured_faster(model):
            why = "measured slower than the static loop for this dtype and device"
        else:
            why = paged_refusal(model, req) or (_tp_refusal(model) if tensor_parallel else None)
        if why is None:
            return run_paged(
                model, req, runner=None if runner is None else runner(),
                sync=sync if tensor_parallel else None,
            )  # fmt: skip
        if cache == "paged":
            raise ConfigError(
                f"generate: kv_cache='paged' cannot run this request: {why}; use "
                "kv_cache='auto' (the static loop where the paged engine does not apply) or "
                "'dynamic'"
            )
    return generation.run(model, req, cache=cache, finished=finished, sync=sync)


def _tp_refusal(model: nn.Module) -> str | None:
    """Why a tensor-parallel ``model`` cannot run paged: the paged forward reads the local
    (split) head count from the projections of the GPT and the LLaMA family only."""
    kind = runner_for(model, fuse=False).kind
    if kind in ("gpt", "llama"):
        return None
    return (
        f"tensor parallelism on the paged engine covers slipstream's GPT and the LLaMA "
        f"family, not {kind}"
    )


def _paged_measured_faster(model: nn.Module) -> bool:
    """Where ``kv_cache="auto"`` picks the paged engine: fp32 weights on the CPU, where its
    fused, packed projections make it faster than the static loop (docs/inference.md). With
    bf16 weights on a CPU with bf16 instructions it measured slower (0.57x against 0.83x HF
    ``generate`` at batch 16), and it has not been timed on CUDA; there the static loop runs."""
    param = next(model.parameters(), None)
    return param is None or (param.dtype == torch.float32 and param.device.type == "cpu")


def _row_generators(req: GenerationRequest, device: torch.device) -> list[torch.Generator | None]:
    if not req.sampling.do_sample:
        return [None] * req.input_ids.shape[0]
    seeds = torch.randint(0, 2**62, (req.input_ids.shape[0],), generator=req.generator,
                          device=req.input_ids.device).tolist()  # fmt: skip
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


@torch.inference_mode()
def run_paged(
    model: nn.Module,
    req: GenerationRequest,
    *,
    block_size: int = 16,
    max_tokens_per_step: int = 2048,
    runner: Runner | None = None,
    sync: RankSync | None = None,
    gather: Gather | None = None,
    all_done: Callable[[bool], bool] | None = None,
    row_max_new: list[int] | None = None,
) -> torch.Tensor:
    """Decode ``req`` on the paged engine: ``[batch, prompt + new]`` token ids, rows that
    ended early padded with ``req.pad_token_id``, as long as the longest row (the static
    engine's output). ``runner``: ``model``'s paged forward to reuse (its packed weights,
    see ``fused.py``), instead of preparing a new one.

    Several processes (each with the same keywords):

    * ``sync``: tensor-parallel ranks decoding the same request (``sync.request`` already
      applied): every rank schedules alike, and each step's tokens are TP rank 0's
      (``sync.tokens``), so the ranks' batches, and the collectives inside the TP layers,
      never fall out of step;
    * ``gather``: the parameters are partitioned between forwards (unpinned ZeRO-3): each
      forward gathers the blocks one at a time (:attr:`Runner.gather`). With ``all_done``
      (ZeRO-3's gathers are collectives), the processes agree once per step whether all of
      them are done; one with nothing left to decode makes the gathers of a forward
      without its compute (:meth:`Runner.keep_pace`) until all are, so every process makes
      the same collectives whatever its rows and their lengths.

    ``row_max_new``: each row's ``max_new_tokens`` (default: ``req.max_new_tokens`` for all).

    Raises:
        RuntimeError: a KV block still allocated after the last request ended (a leak).
    """
    b, t = req.input_ids.shape
    prompts = [
        row[m.bool()].tolist() for row, m in zip(req.input_ids, req.attention_mask, strict=True)
    ]
    limits = row_max_new if row_max_new is not None else [req.max_new_tokens] * b
    longest = max(len(p) + n for p, n in zip(prompts, limits, strict=True))
    if runner is None:
        runner = runner_for(model, gather=gather)
    engine = ContinuousBatchingEngine(
        model, block_size=block_size, max_num_seqs=b, max_tokens_per_step=max_tokens_per_step,
        max_model_len=longest, num_blocks=b * -(-longest // block_size), runner=runner,
        agree=None if sync is None else sync.tokens,
    )  # fmt: skip
    stops = set(req.eos_token_ids)
    gens = _row_generators(req, engine.runner.device)
    for i, prompt in enumerate(prompts):
        engine._add(str(i), prompt, limits[i], req.sampling, gens[i], stops,
                    req.min_new_tokens)  # fmt: skip
    new: list[list[int]] = [[] for _ in range(b)]
    while True:
        idle = not engine.has_unfinished()
        if all_done is None and idle:
            break
        if all_done is not None and all_done(idle):
            break
        forwards = engine.num_forwards
        for step_out in [] if idle else engine.step():
            new[int(step_out.request_id)].extend(step_out.new_token_ids)
        if all_done is not None and engine.num_forwards == forwards:
            engine.runner.keep_pace()  # nothing (left) to run here: the others' gathers
    if engine.free_blocks() != engine.total_blocks():
        raise RuntimeError(
            f"run_paged: {engine.total_blocks() - engine.free_blocks()} KV blocks still "
            "allocated after every request ended (a block accounting bug)"
        )
    width = max(len(n) for n in new)
    out = torch.full((b, t + width), req.pad_token_id, dtype=req.input_ids.dtype,
                     device=req.input_ids.device)  # fmt: skip
    out[:, :t] = req.input_ids
    for i, tokens in enumerate(new):
        out[i, t : t + len(tokens)] = torch.tensor(tokens, dtype=out.dtype)
    return out
