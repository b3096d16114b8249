"""``init_inference`` and ``InferenceEngine``: DeepSpeed-Inference's entry point.

``init_inference`` prepares the model in place, in this order: check the request (a
``tp_size`` the heads or the job cannot take is refused here, before any work), load
``checkpoint``, cast to ``dtype``, split over the tensor-parallel group (``parallel.py``),
quantize (``quant``, or ``dtype="int8"``), ``eval()`` with gradients off. The engine then
only sequences: ``forward`` is the module's, ``generate`` runs the continuous-batching
engine where it applies and slipstream's static decode loop otherwise, ``stream`` the static
loop (``generation.py``), with the engine's limits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference import generation
from slipstream.inference.config import InferenceConfig, read_inference_config
from slipstream.inference.experts import expert_parallel_for_inference
from slipstream.inference.generation import RankSync
from slipstream.inference.kernels import (
    fp32_gemm_for_half_weights_,
    native_half_gemm,
    pack_lm_head_,
)
from slipstream.inference.loading import load_weights
from slipstream.inference.parallel import check_tensor_parallel, parallelize_for_inference
from slipstream.inference.request import call_arguments
from slipstream.moe import moe_layers

__all__ = ["InferenceEngine", "init_inference", "resolve_quant"]

logger = logging.getLogger(__name__)


def resolve_quant(quant: Any, dtype: torch.dtype | None) -> Any:
    """The ``slipstream.quant`` config that ``quant`` / ``dtype="int8"`` ask for, or None.

    ``quant`` may be a ``QuantConfig``, a row name of ``EVAL_CONFIGS`` ("w8a8-int", ...),
    or DeepSpeed's ``{"enabled": bool, "weight": {"num_bits": 8 | 4, "group_size": g}}``.
    """
    from slipstream.quant import HeroModes, QuantConfig, W4A8Int4, W8A8Int
    from slipstream.quant.eval import EVAL_CONFIGS

    if isinstance(quant, QuantConfig):
        return quant
    if isinstance(quant, str):
        if quant not in EVAL_CONFIGS or quant == "fp32":
            names = ", ".join(n for n in EVAL_CONFIGS if n != "fp32")
            raise ConfigError(f"init_inference: quant={quant!r} is unknown; use one of {names}")
        return EVAL_CONFIGS[quant]("int_mm", 64)
    if isinstance(quant, dict) and quant.get("enabled", True):
        weight = quant.get("weight", {})
        bits, group = weight.get("num_bits", 8), weight.get("group_size", 64)
        if bits == 8:
            return W8A8Int(modes=_FLOAT_ATTENTION_CORE(HeroModes))
        if bits == 4:
            return W4A8Int4(group_size=group)
        raise ConfigError(
            f"init_inference: quant.weight.num_bits={bits!r} is not supported; use 8 or 4"
        )
    if quant not in (None, {}) and not isinstance(quant, dict):
        raise ConfigError(
            f"init_inference: quant={quant!r} is not a quantization config; pass a "
            "slipstream.quant config such as W8A8Int(), a name like 'w8a8-int', or "
            '{"enabled": true, "weight": {"num_bits": 8}}'
        )
    return W8A8Int(modes=_FLOAT_ATTENTION_CORE(HeroModes)) if dtype is torch.int8 else None


def _FLOAT_ATTENTION_CORE(modes_cls: Any) -> Any:
    """INT8 GEMMs with the model's own float attention: the INT8 attention core replaces
    slipstream GPT attention only, and Hugging Face models keep theirs."""
    return modes_cls(attn_core=False)


class InferenceEngine:
    """A model prepared for inference; DeepSpeed's ``InferenceEngine`` surface.

    Attributes:
        module: the prepared model (the same object that was passed in, converted in place;
            under tensor parallelism this rank's shard of it).
        config: the validated :class:`InferenceConfig`.
    """

    def __init__(
        self, module: nn.Module, config: InferenceConfig, sync: RankSync | None = None
    ) -> None:
        self.module = module
        self.config = config
        self._sync = sync if sync is not None else RankSync()
        self._paged: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, without autograd."""
        with torch.inference_mode():
            return self.module(*args, **kwargs)

    __call__ = forward

    def _args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = call_arguments(args, kwargs)
        graph = self.config.enable_cuda_graph
        return {
            "max_out_tokens": self.config.max_out_tokens,
            "cache": "graph" if graph else self.config.kv_cache,
            "finished": "mask" if graph else self.config.finished_rows,
            "sync": self._sync,
            **kwargs,
        }

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Hugging Face ``model.generate``: ``[batch, prompt + new]`` token ids.

        See :func:`slipstream.inference.generate` for the arguments; the prompt plus new
        tokens may not exceed ``max_out_tokens``.
        """
        from slipstream.inference.paged_generate import generate_auto

        kw = self._args(args, kwargs)
        cache, finished, sync = kw.pop("cache"), kw.pop("finished"), kw.pop("sync")
        max_out_tokens = kw.pop("max_out_tokens")
        req = generation.prepare(self.module, kw, max_out_tokens, sync)
        tp = self.config.tp_size > 1
        return generate_auto(self.module, req, cache=cache, finished=finished, sync=sync,
                             runner=self._runner, tensor_parallel=tp)  # fmt: skip

    def _runner(self) -> Any:
        """The module's paged forward, prepared on first use and kept (its packed weights
        are rebuilt only when a weight changes, see ``fused.py``)."""
        if self._paged is None:
            from slipstream.inference.paged_models import runner_for

            self._paged = runner_for(self.module)
        return self._paged

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        """Yield each step's tokens ``[batch]`` as they are produced (same arguments)."""
        return generation.stream(self.module, **self._args(args, kwargs))


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Prepare ``model`` for inference and return an :class:`InferenceEngine`.

    Args:
        model: a ``torch.nn.Module`` (Hugging Face causal LMs get ``generate``).
        config: a dict of DeepSpeed inference keys, an :class:`InferenceConfig`, or None.
        **kwargs: the same keys as keyword arguments (``dtype=torch.bfloat16``,
            ``tensor_parallel={"tp_size": 1}``, ``max_out_tokens=2048``, ``quant=...``).

    Raises:
        ConfigError: an unknown key (with a did-you-mean), a bad value, a key given twice
            with different values, or a setting slipstream refuses; with ``tp_size`` > 1, a
            size that does not divide the heads or the number of processes; ``ep_size`` > 1
            together with ``tp_size`` > 1.

    With ``tp_size`` > 1 every process of the group calls this with the same model (same
    weights: TP rank 0's are broadcast) and then the same ``generate`` calls; generated
    tokens are identical on every rank.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"init_inference: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    cfg = read_inference_config(config, kwargs)
    ep, tp = cfg.moe_ep_size, cfg.tp_size
    if ep > 1 and tp > 1:
        raise ConfigError(
            f"init_inference: config key 'ep_size' = {ep} with tensor_parallel.tp_size = {tp}: "
            "expert parallelism combined with tensor parallelism is not supported in "
            f"inference; use tp_size {tp} with ep_size 1 (attention and dense layers split, "
            f"every rank holding all experts) or ep_size {ep} with tp_size 1"
        )
    check_tensor_parallel(model, cfg)
    quant = resolve_quant(cfg.quant, cfg.dtype)
    if cfg.checkpoint is not None:
        load_weights(model, cfg.checkpoint, cfg.base_dir)
    if cfg.torch_dtype is not None:
        model.to(cfg.torch_dtype)
    sync = parallelize_for_inference(model, cfg) if cfg.tp_size > 1 else None
    if cfg.moe_ep_size > 1 or moe_layers(model):
        sync = expert_parallel_for_inference(model, cfg.moe_ep_size) or sync
    if quant is not None:
        from slipstream.quant import quantize_

        quantize_(model, quant)
    half = cfg.torch_dtype in (torch.bfloat16, torch.float16)
    emulated = cfg.cpu_half_gemm == "auto" and not native_half_gemm()
    fp32_gemms = half and (cfg.cpu_half_gemm == "fp32" or emulated)
    if fp32_gemms:
        fp32_gemm_for_half_weights_(model)
    if cfg.cpu_lm_head == "packed" and quant is None and (fp32_gemms or not half):
        pack_lm_head_(model)
    if cfg.enable_cuda_graph:
        _check_cuda_graph(model, cfg)
    model.eval()
    model.requires_grad_(False)
    return InferenceEngine(model, cfg, sync)


def _check_cuda_graph(model: nn.Module, cfg: InferenceConfig) -> None:
    """``enable_cuda_graph`` needs a Hugging Face causal LM on a CUDA device, one rank."""
    from slipstream.inference.hf import is_hf_causal_lm

    device = next(model.parameters()).device
    problem = None
    if not is_hf_causal_lm(model):
        problem = f"{type(model).__name__} is not a Hugging Face causal LM"
    elif device.type != "cuda":
        problem = f"the model is on {device}, not a CUDA device (move it with model.cuda())"
    elif cfg.tp_size > 1:
        problem = f"tp_size={cfg.tp_size}: the graph is captured for one rank"
    if problem is not None:
        raise ConfigError(
            f"init_inference: enable_cuda_graph=True needs a Hugging Face causal LM on a CUDA "
            f"device without tensor parallelism; {problem}. Set enable_cuda_graph=False."
        )
