"""Tensor-parallel inference: ``init_inference(model, tensor_parallel={"tp_size": N})``.

The model is split with the training side's tensor parallelism
(``slipstream.parallel.tensor.parallelize_tp_``): the reference GPT by its own plan
(``GPT.tp_plan``: Megatron's attention and MLP split, a vocabulary-parallel embedding and LM
head whose logits are gathered), Hugging Face models by the automatic plan (AutoTP: the LM
head column-parallel with its output gathered). Each rank then holds ``1/N`` of every layer
and of the KV cache (its own heads), and every rank computes the full logits.

The ranks must then choose the same token at every step, or their batches (finished rows
leave them) and their collectives fall out of step. :class:`TPRankSync` makes sure of it:
before the prompt reaches the model it checks that every rank asks for the same generation
and gives all ranks TP rank 0's sampling RNG stream (a ``seed`` means the same on every
rank, and without one the ranks still draw alike); at every step it broadcasts TP rank 0's
chosen tokens, so a last-bit difference between ranks' logits can never split them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.distributed import comm
from slipstream.distributed.mesh import consecutive_group
from slipstream.inference.config import InferenceConfig
from slipstream.inference.generation import RankSync
from slipstream.inference.request import GenerationRequest
from slipstream.parallel.tensor import parallelize_tp_

__all__ = ["TPRankSync", "check_tensor_parallel", "check_tp_heads", "parallelize_for_inference"]

# Config attributes holding head counts: the reference GPT's, then Hugging Face's names.
_HEAD_COUNTS = (
    "num_heads", "num_kv_heads", "num_attention_heads", "num_key_value_heads", "n_head",
)  # fmt: skip


def _world_size() -> int:
    """The number of processes of this job, without starting ``torch.distributed``."""
    if comm.is_initialized():
        return comm.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_tp_heads(
    config: Any, tp: int, what: str, key: str = "init_inference: tensor_parallel.tp_size"
) -> None:
    """Refuse a ``tp`` that does not divide the head counts of a model ``config``.

    ``what`` names the model and ``key`` the setting in the message (the hybrid engine's
    ``inference_tp_size`` uses it too).

    Raises:
        ConfigError: naming the attribute, its value and ``tp``.
    """
    for attr in _HEAD_COUNTS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            raise ConfigError(
                f"{key}={tp} does not divide {what}'s {attr}={value}: every rank must hold "
                f"whole attention heads; use a size that divides {value}"
            )


def check_tensor_parallel(model: nn.Module, cfg: InferenceConfig) -> None:
    """Refuse a tensor-parallel request that cannot work, before any work starts.

    Raises:
        ConfigError: ``tp_size`` does not divide the model's attention heads; the job has
            fewer processes than ``tp_size`` or a number it does not divide; ``quant`` is
            combined with ``tp_size`` > 1; ``training_mp_size`` is not 1.
    """
    tp = cfg.tp_size
    if cfg.training_mp_size != 1:
        raise ConfigError(
            f"init_inference: training_mp_size={cfg.training_mp_size} needs tensor-parallel "
            "checkpoint merging, which is not implemented; export a consolidated checkpoint "
            "(slipstream convert) and load that"
        )
    if tp == 1:
        return
    check_tp_heads(getattr(model, "config", None), tp, type(model).__name__)
    if cfg.quant is not None or cfg.dtype is torch.int8:
        raise ConfigError(
            f"init_inference: quantization (quant / dtype='int8') with tensor_parallel."
            f"tp_size={tp} is not supported: the INT8 layers replace plain nn.Linear, not "
            "the tensor-parallel ones; use tp_size=1 with quant, or tp without it"
        )
    world = _world_size()
    if world < tp or world % tp:
        raise ConfigError(
            f"init_inference: tensor_parallel.tp_size={tp} needs a multiple of {tp} processes, "
            f"but this job has {world}; start it with `slipstream run --nproc {tp} "
            f"script.py` (or torchrun --nproc_per_node {tp}), or `slipstream generate "
            f"--tp {tp}` for the CLI"
        )


def _tp_group(cfg: InferenceConfig) -> comm.Group:
    """The caller's group (``tensor_parallel.tp_group``, or its ``mpu``'s), else
    consecutive ranks in groups of ``tp_size`` (the whole world when it is one group)."""
    tp_cfg = cfg.tensor_parallel
    if tp_cfg.tp_group is not None:
        return tp_cfg.tp_group
    if tp_cfg.mpu is not None:
        for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
            if callable(getattr(tp_cfg.mpu, name, None)):
                return getattr(tp_cfg.mpu, name)()
        raise ConfigError(
            f"init_inference: tensor_parallel.mpu ({type(tp_cfg.mpu).__name__}) has no "
            "get_tensor_model_parallel_group() or get_model_parallel_group(); pass tp_group"
        )
    return consecutive_group(cfg.tp_size, axis="tp")


def parallelize_for_inference(model: nn.Module, cfg: InferenceConfig) -> TPRankSync:
    """Start ``torch.distributed`` if needed, split ``model`` over its TP group, in place.

    Returns the :class:`TPRankSync` that keeps the group's ranks generating alike.
    """
    comm.init_distributed()
    group = _tp_group(cfg)
    size = comm.get_world_size(group)
    if size != cfg.tp_size:
        raise ConfigError(
            f"init_inference: tensor_parallel.tp_group has {size} ranks, tp_size is "
            f"{cfg.tp_size}; give a group of tp_size ranks"
        )
    parallelize_tp_(model, group)
    return TPRankSync(group)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class TPRankSync(RankSync):
    """The tensor-parallel :class:`RankSync`: one request, one RNG stream, one token choice."""

    def __init__(self, group: comm.Group) -> None:
        self.group = group
        self.src = comm.global_rank(group, 0)

    def request(self, req: GenerationRequest) -> GenerationRequest:
        """Check every rank asks for the same generation; give all TP rank 0's RNG stream.

        Raises:
            RuntimeError: on every rank, when the ranks' requests differ (naming which).
        """
        what = (
            tuple(req.input_ids.shape), _digest(req.input_ids), _digest(req.attention_mask),
            req.max_new_tokens, req.min_new_tokens, req.sampling, req.eos_token_ids,
            req.pad_token_id, req.stop_strings,
        )  # fmt: skip
        comm.check_same_across_ranks(
            what, "the generate request (prompt ids, attention mask, lengths, sampling)",
            self.group,
        )  # fmt: skip
        if not req.sampling.do_sample:
            return req
        gen = req.generator
        if gen is None:  # the global RNG: rank 0's draw seeds everyone's stream
            seed = int(torch.randint(2**62, (1,)))
            gen = torch.Generator(device=req.input_ids.device)
            gen.manual_seed(comm.all_gather_object(seed, self.group)[0])
        else:
            gen.set_state(comm.all_gather_object(gen.get_state(), self.group)[0])
        return dataclasses.replace(req, generator=gen)

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """TP rank 0's tokens, on every rank."""
        comm.broadcast(tokens, src=self.src, group=self.group, label="tp_tokens")
        return tokens
