"""The model half of the autotuner: candidate layouts of a training config, ranked by the
planner (``slipstream tune`` measures the best of them; docs/planner.md).

DeepSpeed's autotuner explores ZeRO stages and micro-batch sizes by running them; here the
analytic planner enumerates every layout the config leaves open (tensor-parallel size, ZeRO
stage, micro-batch, hence global batch and accumulation), drops those predicted not to fit in
memory, and ranks the rest by the predicted metric, so only the few most promising are run.
What the training script decides and a config cannot change is held: the pipeline stages
(the script builds its ``PipelineModule``), recomputation (the model's own switch) and
precision.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from slipstream.config.autotuning import AutotuningConfig, ModelInfoConfig
from slipstream.planner.export import layout_to_config
from slipstream.planner.flops import model_flops
from slipstream.planner.hardware import Hardware
from slipstream.planner.layout import Recompute
from slipstream.planner.model import ModelSpec, from_hf_config, megatron_gpt
from slipstream.planner.predict import Prediction
from slipstream.planner.search import search

__all__ = [
    "Candidate",
    "candidate_config",
    "metric_value",
    "model_from_info",
    "rank_candidates",
    "select_for_measurement",
]

# Keys the tuner sets in each candidate's config (the rest of the user's config is kept).
_TUNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps", "data_parallel_size")  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One layout to try: its name, the planner's prediction and the config a run gets."""

    name: str
    prediction: Prediction
    config: dict[str, Any]

    @property
    def predicted_metric(self) -> dict[str, float]:
        p = self.prediction
        return {
            "throughput": p.samples_per_s,
            "latency": p.step_time_s,
            "flops": p.model_flops / p.step_time_s,
        }


def model_from_info(info: ModelInfoConfig) -> ModelSpec:
    """The planner's model from ``autotuning.model_info``.

    With ``intermediate_size`` it is a LLaMA-style model (slipstream's reference GPT, a Hugging
    Face Llama); without, a Megatron GPT. ``num_params``, when given, must agree with the
    shape within 10%.

    Raises:
        ValueError: a required key is missing, or ``num_params`` disagrees with the shape.
    """
    need = ("hidden_size", "num_layers", "num_attention_heads", "vocab_size", "seq_length")
    missing = [k for k in need if getattr(info, k) is None]
    if missing:
        raise ValueError(
            f"autotuning.model_info lacks {missing}: the planner needs the model's shape "
            f"({', '.join(need)}; intermediate_size and num_key_value_heads for a LLaMA-style "
            "model such as slipstream.models.GPT)"
        )
    assert info.hidden_size and info.num_layers and info.num_attention_heads
    assert info.vocab_size and info.seq_length
    if info.intermediate_size is not None:
        model = from_hf_config(
            {
                "num_hidden_layers": info.num_layers,
                "hidden_size": info.hidden_size,
                "num_attention_heads": info.num_attention_heads,
                "num_key_value_heads": info.num_key_value_heads,
                "intermediate_size": info.intermediate_size,
                "vocab_size": info.vocab_size,
                "tie_word_embeddings": bool(info.tie_word_embeddings),
                "model_type": "model_info",
            },
            seq=info.seq_length,
        )
    else:
        model = megatron_gpt(
            info.num_layers, info.hidden_size, info.num_attention_heads,
            vocab=info.vocab_size, seq=info.seq_length, name="model_info",
        )  # fmt: skip
    if info.num_params is not None:
        counted = model.num_params()
        if abs(counted - info.num_params) > 0.1 * info.num_params:
            raise ValueError(
                f"autotuning.model_info.num_params = {info.num_params} but the shape gives "
                f"{counted} parameters: check the shape keys (or drop num_params)"
            )
    return model


def _dtype(config: dict[str, Any]) -> str:
    for key in ("bf16", "bfloat16", "fp16"):
        block = config.get(key)
        if isinstance(block, dict) and block.get("enabled"):
            return "fp16" if key == "fp16" else "bf16"
    return "fp32"


def _fixed(config: dict[str, Any], at: AutotuningConfig, recompute: Recompute) -> dict[str, Any]:
    """Layout fields the config (or the script) decides."""
    dtype = _dtype(config)
    zero = config.get("zero_optimization") or {}
    tp_block = config.get("tensor_parallel") or {}
    pipe = config.get("pipeline") or {}
    fixed: dict[str, Any] = {
        "pp": int(pipe.get("stages") or pipe.get("num_stages") or 1),
        "virtual_stages": int(pipe.get("virtual_stages") or 1),
        "recompute": recompute,
        "sequence_parallel": bool(tp_block.get("sequence_parallel", False)),
        "param_bytes": 4 if dtype == "fp32" else 2,
    }
    tp = tp_block.get("autotp_size") or tp_block.get("tp_size")
    if at.mp_size > 1:
        tp = at.mp_size
    if tp:
        fixed["tp"] = int(tp)
    if "stage" in zero:
        fixed["zero_stage"] = int(zero["stage"])
    micro = config.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int):
        fixed["micro_batch"] = micro
    return fixed


def _global_batches(config: dict[str, Any], at: AutotuningConfig, world: int) -> list[int]:
    """The global batch when the config fixes it; else micro-batches (powers of two from
    the minimum) times the accumulation times the world, inside the batch bounds."""
    batch = config.get("train_batch_size")
    if isinstance(batch, int):
        return [batch]
    accumulation = config.get("gradient_accumulation_steps")
    accumulation = accumulation if isinstance(accumulation, int) else 1
    micro, out = at.min_train_micro_batch_size_per_gpu, list[int]()
    while (
        micro <= at.max_train_micro_batch_size_per_gpu
        and len(out) < at.num_tuning_micro_batch_sizes
    ):
        total = micro * accumulation * world
        if total >= at.min_train_batch_size and (
            at.max_train_batch_size is None or total <= at.max_train_batch_size
        ):
            out.append(total)
        micro *= 2
    if not out:
        raise ValueError(
            "autotuning: no global batch between min_train_batch_size "
            f"{at.min_train_batch_size} and max_train_batch_size {at.max_train_batch_size} "
            f"for micro-batches {at.min_train_micro_batch_size_per_gpu}-"
            f"{at.max_train_micro_batch_size_per_gpu} x accumulation {accumulation} x "
            f"{world} ranks"
        )
    return out


def candidate_config(base: dict[str, Any], prediction: Prediction) -> dict[str, Any]:
    """``base`` (the user's config) with the layout's keys set and the ``autotuning`` block
    removed; ZeRO options the user set are kept, the stage replaced."""
    layout = prediction.layout
    out = copy.deepcopy(base)
    out.pop("autotuning", None)
    tuned = layout_to_config(layout, dtype=_dtype(base))
    for key in _TUNED_KEYS:
        out[key] = tuned[key]
    out["zero_optimization"] = {**(base.get("zero_optimization") or {}),
                                "stage": layout.zero_stage}  # fmt: skip
    if layout.tp > 1:
        out["tensor_parallel"] = {**(base.get("tensor_parallel") or {}), **tuned["tensor_parallel"]}
    elif "tensor_parallel" in out:
        out["tensor_parallel"] = {**out["tensor_parallel"], "autotp_size": 1}
    return out


def _name(p: Prediction) -> str:
    lay = p.layout
    return f"tp{lay.tp}_pp{lay.pp}_dp{lay.dp}_z{lay.zero_stage}_mbs{lay.micro_batch}_gas{lay.micro_batches}"


def metric_value(metric: str, samples_per_s: float, model_flops_per_step: float,
                 batch: int) -> float:  # fmt: skip
    """The value "best" compares (higher is better; latency is negated)."""
    step = batch / samples_per_s
    if metric == "latency":
        return -step
    if metric == "flops":
        return model_flops_per_step / step
    return samples_per_s


def rank_candidates(
    model: ModelSpec,
    hardware: Hardware,
    base: dict[str, Any],
    at: AutotuningConfig,
    world: int,
    *,
    recompute: Recompute = "none",
) -> tuple[list[Candidate], int, int]:
    """Every layout that fits, best predicted metric first.

    Returns:
        (candidates, enumerated, rejected for memory).
    Raises:
        ValueError: nothing can be enumerated (the message names the constraint).
    """
    fixed = _fixed(base, at, recompute)
    ranked: list[Prediction] = []
    enumerated = rejected = 0
    for batch in _global_batches(base, at, world):
        try:
            result = search(model, hardware, world, batch, fixed)
        except ValueError:
            continue
        enumerated += result.enumerated
        rejected += result.rejected_memory
        ranked.extend(result.ranked)
    if not enumerated:
        raise ValueError(
            f"autotuning: no layout of {world} ranks satisfies the config's fixed fields "
            f"{fixed} for {model.heads} heads and {model.layers} layers"
        )

    def key(p: Prediction) -> float:
        return -metric_value(at.metric, p.samples_per_s, model_flops(model, p.layout.batch),
                             p.layout.batch)  # fmt: skip

    ranked.sort(key=lambda p: (key(p), p.memory_per_rank_bytes))
    return [Candidate(_name(p), p, candidate_config(base, p)) for p in ranked], enumerated, rejected


def select_for_measurement(
    candidates: list[Candidate], at: AutotuningConfig, top: int | None
) -> list[Candidate]:
    """The candidates to run: ``top`` (else 3 when ``fast``, else ``tuner_num_trials``), in
    the planner's order, or a seeded random sample for ``tuner_type`` "random"."""
    count = top if top is not None else (3 if at.fast else at.tuner_num_trials)
    pool = list(candidates)
    if at.tuner_type == "random":
        random.Random(0).shuffle(pool)
    return pool[: max(1, count)]
