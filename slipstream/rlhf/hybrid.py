"""The hybrid engine: generation on a ZeRO training engine (DeepSpeed-Chat's DeepSpeed-HE).

Yao et al. 2023 (arXiv 2308.01320, section 5): RLHF's actor alternates between training
(ZeRO-sharded) and generating answers (hundreds of sequential decode steps). Gathering each
ZeRO-3 layer for every token makes generation bound by all-gathers; the hybrid engine gathers
the parameters once per ``generate`` call, decodes on the gathered model (slipstream's
continuous-batching engine on a paged KV cache, :mod:`slipstream.inference.paged_generate`,
where it applies, else the static decode loop of :mod:`slipstream.inference.generation`;
see :meth:`HybridEngine.run`), and releases them when the
call returns, so the training layout (each rank holding its 1/N shard, optimizer state as it
was) is back before ``engine.train()``. LoRA adapters (:mod:`slipstream.models.lora`) are
fused into the base weights for the call and the unfused weights put back after, as
DeepSpeed-HE does (``HybridEngine._lora``).

``pin_parameters: false`` keeps ZeRO-3's per-layer gathering (one layer's memory, every
token re-gathers every layer); the ranks then step in lock-step (a rank with nothing left to
decode makes a forward's gathers without its compute) because every forward is a collective.

It is attached by ``slipstream.initialize`` when the config's ``hybrid_engine.enabled`` is
true (an engine extension, :mod:`slipstream.runtime.extensions`): ``engine.generate`` and,
as DeepSpeed-Chat's PPO trainer calls it, ``engine.module.generate`` run through it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.config.hybrid import HybridEngineConfig
from slipstream.distributed import comm
from slipstream.inference import generation, hf
from slipstream.inference.paged_generate import paged_refusal, run_paged
from slipstream.inference.request import build_request, call_arguments, check_length
from slipstream.models.decoding import GenerationRequest, generation_request
from slipstream.models.gpt import GPT
from slipstream.models.lora import LoRALinear, fused_lora
from slipstream.rlhf.hybrid_tp import TPGenerator
from slipstream.runtime.engine import Engine
from slipstream.runtime.extensions import register_engine_extension
from slipstream.zero import gathered_model
from slipstream.zero.gathered import forward_gathered
from slipstream.zero.sharded_store import unit_owner

__all__ = ["GenerationStats", "HybridEngine", "enable_hybrid_engine_"]

_GPT_GENERATE = inspect.signature(GPT.generate)


@dataclass
class GenerationStats:
    """Time and calls of the hybrid engine, summed since the engine was built.

    Attributes:
        calls: ``generate`` calls.
        gather_seconds: time gathering parameters before and releasing them after the decode
            loop (pinned ZeRO-3; about 0 otherwise).
        generate_seconds: time in the decode loop (per-layer gathers included when unpinned).
        new_tokens: generated columns summed over calls (times the batch rows).
        paged_calls: calls decoded on the continuous-batching engine (the rest on the
            static decode loop; see :meth:`HybridEngine.run`).
    """

    calls: int = 0
    gather_seconds: float = 0.0
    generate_seconds: float = 0.0
    new_tokens: int = 0
    paged_calls: int = 0


class HybridEngine:
    """``generate`` for a training :class:`~slipstream.runtime.engine.Engine`.

    Args:
        engine: the training engine (its module: a Hugging Face causal LM or slipstream's GPT).
        config: the ``hybrid_engine`` block.
    """

    def __init__(self, engine: Engine, config: HybridEngineConfig) -> None:
        self.engine = engine
        self.config = config
        self.stats = GenerationStats()
        self.rollouts: Literal["paged", "static"] = "paged"
        """``"paged"``: decode on the continuous-batching engine where it applies (see
        :meth:`run`); ``"static"``: always the static decode loop."""
        self._sync_group = _zero3_group(engine.module)
        # ZeRO-3 releases parameters between forwards even in a world of one (not partitioned,
        # so no sync group): gathering them once per call is needed there too.
        self._released = any(unit_owner(p) is not None for p in engine.module.parameters())
        self.has_lora = any(isinstance(m, LoRALinear) for m in engine.module.modules())
        self._tp: TPGenerator | None = None
        if config.inference_tp_size > 1:
            self._tp = TPGenerator(
                engine.module,
                config.inference_tp_size,
                config.tp_gather_partition_size,
                zero3=self.zero3,
                device=engine.device,
            )

    @property
    def zero3(self) -> bool:
        """Whether the module's parameters are ZeRO-3 partitioned."""
        return self._sync_group is not False

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Hugging Face ``generate`` semantics: ``[batch, prompt + new]`` token ids.

        ``engine.generate`` (and a Hugging Face module's ``generate``): takes the arguments
        of :func:`slipstream.inference.generate` (HF's names); the first positional argument
        (or ``inputs=``) is ``input_ids``; ``synced_gpus`` is accepted and not needed. Every
        rank of a ZeRO-3 engine must call it (each with its own prompts). A prompt plus new
        tokens longer than ``hybrid_engine.max_out_tokens`` is refused before any work.
        """
        try:
            req = build_request(self.engine.module, call_arguments(args, kwargs))
        except ConfigError as e:
            if self._tp is None:
                raise
            self._tp.refuse(str(e))  # every rank raises, none waits in a collective
            raise
        return self.run(req)

    def module_generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A reference GPT module's ``generate`` once the hybrid engine is on: a call
        ``GPT.generate`` accepts (``generate(ids, max_new_tokens, temperature=..., top_k=...,
        generator=...)``) means what it means there (``temperature`` 0: greedy, else
        sampling); any other call is read as Hugging Face's, as :meth:`generate`."""
        try:
            call = _GPT_GENERATE.bind(None, *args, **kwargs)
        except TypeError:
            return self.generate(*args, **kwargs)
        own = dict(call.arguments)
        own.pop("self")
        req = generation_request(**own)
        # GPT.generate's draws come from its generator in batch order: the static loop's.
        return self.run(req, paged=not req.sampling.do_sample)

    def run(self, req: GenerationRequest, *, paged: bool = True) -> torch.Tensor:
        """Decode a typed request (the package's own callers: PPO, GRPO): ``[batch, prompt +
        new]`` token ids, a copy that may enter a training forward.

        Runs on the continuous-batching engine (:mod:`slipstream.inference.paged_generate`:
        each row a request, the copies of one prompt sharing its KV blocks, finished rows
        leaving the batch) unless the request has stop strings or a streamer, the model is
        not one the paged forward drives or is in training mode, ``rollouts`` is
        ``"static"`` or ``paged`` is False; then on the static decode loop. Unpinned ZeRO-3
        (parameters gathered per forward, a collective): the paged forward gathers one block
        at a time, the ranks agree first that all of them run paged, and then step in
        lock-step (``run_paged``'s ``all_done``). ``inference_tp_size`` > 1:
        :meth:`TPGenerator.generate`. Greedy tokens are the same either way; sampled ones
        come from per-row generators on the paged engine.
        """
        if self._tp is not None:
            return self._generate_tp(self._tp, req, paged and self.rollouts == "paged")
        module = self.engine.module
        check_length(
            req, self.config.max_out_tokens, generation.driver_for(module).context_length(module)
        )
        pinned = self._released and self.config.pin_parameters
        # Unpinned ZeRO-3: the paged forward gathers each block as it runs it.
        gather = forward_gathered if self._released and not pinned else None
        started = time.perf_counter()
        with gathered_model(module) if pinned else nullcontext(), self._lora(pinned):
            decode_started = time.perf_counter()
            all_done = self._all_done()
            paged = paged and self.rollouts == "paged" and paged_refusal(module, req) is None
            if all_done is not None:  # lock-step: every rank decodes on the same loop
                paged = all_done(paged)
            if paged:
                out = run_paged(module, req, gather=gather, all_done=all_done)
                self.stats.paged_calls += 1
            else:
                out = generation.run(module, req, all_done=all_done)
            decoded = time.perf_counter() - decode_started
        self.stats.calls += 1
        self.stats.generate_seconds += decoded
        self.stats.gather_seconds += time.perf_counter() - started - decoded
        self.stats.new_tokens += out.shape[0] * (out.shape[1] - req.input_ids.shape[1])
        # The decode loop runs under inference_mode; its output could not enter the training
        # forward that follows (autograd refuses inference tensors), so hand out a copy.
        return out.clone()

    def _lora(self, pinned: bool) -> AbstractContextManager[Any]:
        """Fuse the LoRA adapters into the base weights for the decode loop (one GEMM per
        layer, as DeepSpeed-HE) and restore the unfused weights after.

        The fuse needs whole weights: under ZeRO-3 it runs only when pinned, on the gathered
        copies, and the kept unfused copy is put back before the gather is released (so
        neither a persistent unit nor ZeRO++'s hpZ secondary copy, both of which keep
        gathered values, ever sees a fused weight). Restoring the kept copy, instead of
        subtracting ``B A`` again, leaves the weights bit-for-bit as they were: a round trip
        never drifts, at the price of one copy of the converted layers' weights while
        generating. Unpinned ZeRO-3 gathers one layer at a time, so the adapters run unfused
        (the same function, two small GEMMs more per converted layer).
        """
        if not self.has_lora or (self._released and not pinned):
            return nullcontext()
        return fused_lora(self.engine.module, keep_base=True)

    def _generate_tp(self, tp: TPGenerator, req: GenerationRequest, paged: bool) -> torch.Tensor:
        """``inference_tp_size`` > 1: the TP group builds its split copy (layer groups
        gathered once) and decodes the group's prompts together (:mod:`.hybrid_tp`), on the
        continuous-batching engine where it applies (``paged``)."""
        started, gathered, calls = time.perf_counter(), tp.gather_seconds, tp.paged_calls
        out = tp.generate(req, self.config.max_out_tokens, paged=paged)
        self.stats.paged_calls += tp.paged_calls - calls
        building = tp.gather_seconds - gathered
        self.stats.calls += 1
        self.stats.gather_seconds += building
        self.stats.generate_seconds += time.perf_counter() - started - building
        self.stats.new_tokens += out.shape[0] * (out.shape[1] - req.input_ids.shape[1])
        return out.clone()

    def _all_done(self) -> Callable[[bool], bool] | None:
        """Unpinned ZeRO-3: every forward is a collective, so the ranks agree each step."""
        if not self.zero3 or self.config.pin_parameters:
            return None
        group = self._sync_group

        def all_done(done: bool) -> bool:
            return comm.all_true(done, group=group, label="hybrid_sync")

        return all_done


def _zero3_group(module: nn.Module) -> Any:
    """The data-parallel group ZeRO-3 gathers ``module``'s parameters over, or False when no
    parameter is partitioned."""
    for p in module.parameters():
        owner = unit_owner(p)
        if owner is not None:
            return owner.store.group if owner.store.partitioned else False
    return False


def _check_supported(engine: Engine) -> None:
    """Refuse, before training starts, what the hybrid engine cannot serve."""
    module, cfg = engine.module, engine.config
    if not (isinstance(module, GPT) or hf.is_hf_causal_lm(module)):
        raise ConfigError(
            f"hybrid_engine.enabled is true but the model is a {type(module).__name__}, not a "
            "causal language model the generation path can drive (slipstream's GPT, or a "
            "Hugging Face model with can_generate(): LlamaForCausalLM, GPT2LMHeadModel, ...); "
            "set hybrid_engine.enabled to false for this model"
        )
    if cfg.tensor_parallel.autotp_size > 1 or cfg.sequence_parallel_size > 1:
        raise ConfigError(
            "hybrid_engine.enabled with tensor_parallel.autotp_size="
            f"{cfg.tensor_parallel.autotp_size} / sequence_parallel_size="
            f"{cfg.sequence_parallel_size}: generation runs data-parallel only (every rank its "
            "own prompts); use ZeRO (any stage) without tensor or sequence parallelism"
        )


def enable_hybrid_engine_(engine: Engine) -> HybridEngine:
    """Give ``engine`` (and its module) the hybrid engine's ``generate``, in place.

    Sets ``engine.hybrid_engine`` (the :class:`HybridEngine`, with its ``stats``),
    ``engine.generate`` (Hugging Face's arguments) and ``engine.module.generate``, which
    takes every call the module's own ``generate`` takes, with the same meaning (Hugging
    Face's arguments for a transformers model; for the reference GPT ``GPT.generate``'s, and
    Hugging Face's besides: :meth:`HybridEngine.module_generate`).

    Raises:
        ConfigError: a model that is not a causal LM, or tensor/sequence parallelism.
    """
    _check_supported(engine)
    hybrid = HybridEngine(engine, engine.config.hybrid_engine)
    # Plain attributes (nn.Module.__setattr__ stores non-module values in __dict__), so
    # DeepSpeed-Chat's ``actor.module.generate(...)`` reaches the hybrid path too.
    object.__setattr__(engine, "hybrid_engine", hybrid)
    object.__setattr__(engine, "generate", hybrid.generate)
    own = hybrid.module_generate if isinstance(engine.module, GPT) else hybrid.generate
    object.__setattr__(engine.module, "generate", own)
    return hybrid


register_engine_extension("hybrid_engine", enable_hybrid_engine_)
