"""Activation checkpointing (``deepspeed.checkpointing``): recompute instead of storing.

``checkpoint(fn, *args)`` runs ``fn`` without keeping its intermediate activations and runs
it again in backward. Options (``configure`` or the ``activation_checkpointing`` config
block, which ``slipstream.initialize`` applies):

- full recompute (default): only the inputs of ``fn`` are kept;
- ``partition_activations``: under tensor parallelism those inputs are identical on every
  TP rank, so each rank keeps 1/tp of them and the recompute all-gathers them back;
- ``cpu_checkpointing``: the kept inputs wait in host memory (on an accelerator, in
  page-locked buffers filled by asynchronous copies; on a CPU they are in host memory
  already and stay where they are, so only the recompute mode changes);
- ``selective``: matrix multiplications and attention keep their outputs and only the cheap
  ops (norms, activations, elementwise) are recomputed (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 5).

Dropout recomputes the same mask: the default RNG state and the tensor-parallel RNG
tracker's states (``slipstream.parallel.random``) are restored around the recompute.

Where the state lives: the options, the TP group for partitioning and the RNG tracker to
replay belong to a :class:`RecomputeContext` object. ``slipstream.initialize`` builds one per
engine (from the config, with that engine's TP group and tracker) and hands it to the model
with :func:`use_recompute_context_`, so two engines in one process never see each other's
options. The module-level functions (DeepSpeed's API: ``configure``, ``checkpoint``,
``is_configured``, ...) act on :data:`DEFAULT_CONTEXT`, the process-wide instance that a model
uses until an engine gives it its own. A module that recomputes declares a
``recompute_context`` attribute (the GPT, a ``PipelineModule``) and calls
``self.recompute_context.run(layer, *args)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as torch_checkpoint,
)

from slipstream.accelerator import get_accelerator
from slipstream.config._errors import ConfigError
from slipstream.config.loader import load_config
from slipstream.config.parallel import ActivationCheckpointingConfig
from slipstream.distributed import comm
from slipstream.parallel.random import (
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_manual_seed,
)

__all__ = [
    "DEFAULT_CONTEXT",
    "RecomputeContext",
    "bind_hf_checkpointing_",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
    "use_recompute_context_",
]

logger = logging.getLogger(__name__)


class RecomputeContext:
    """Activation-recomputation state of one engine: options, TP group, RNG tracker.

    Args:
        rng_tracker: the tracker whose streams a recompute replays (default: the
            process-wide one); under tensor parallelism, the tracker the TP plan forks from.
    """

    def __init__(self, rng_tracker: RNGStatesTracker | None = None) -> None:
        self.rng_tracker = rng_tracker if rng_tracker is not None else get_rng_tracker()
        self.options = ActivationCheckpointingConfig()
        self.tp_group: comm.Group = None
        self.configured = False
        self.num_layers: int | None = None

    def configure(
        self,
        mpu_: Any = None,
        deepspeed_config: ActivationCheckpointingConfig | dict[str, Any] | str | None = None,
        partition_activations: bool | None = None,
        contiguous_checkpointing: bool | None = None,
        num_checkpoints: int | None = None,
        checkpoint_in_cpu: bool | None = None,
        synchronize: bool | None = None,
        profile: bool | None = None,
        selective: bool | None = None,
    ) -> None:
        """Set the options of :meth:`checkpoint`; see the module function :func:`configure`."""
        options = _options_from(deepspeed_config)
        overrides = {
            "partition_activations": partition_activations,
            "contiguous_memory_optimization": contiguous_checkpointing,
            "number_checkpoints": num_checkpoints,
            "cpu_checkpointing": checkpoint_in_cpu,
            "synchronize_checkpoint_boundary": synchronize,
            "profile": profile,
            "selective": selective,
        }
        update = {k: v for k, v in overrides.items() if v is not None}
        if update:
            options = ActivationCheckpointingConfig.model_validate(options.model_dump() | update)
        if options.selective and (options.partition_activations or options.cpu_checkpointing):
            raise ConfigError(
                "activation_checkpointing.selective keeps matmul outputs, which is incompatible "
                "with partition_activations / cpu_checkpointing (they move the kept inputs of a "
                "fully recomputed region): choose selective or the other two"
            )
        self.options = options
        self.tp_group = _tp_group_of(mpu_)
        self.configured = True

    def reset(self) -> None:
        """Back to defaults (full recompute, nothing partitioned or offloaded)."""
        self.options, self.tp_group = ActivationCheckpointingConfig(), None
        self.configured, self.num_layers = False, None

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run ``function(*args)`` without storing its activations; recompute them in
        backward, honouring the configured options. Tensor outputs only (a tensor or a
        tuple/list of tensors and non-tensors)."""
        if self.options.selective:
            return _selective(function, self.rng_tracker, *args)
        if not torch.is_grad_enabled():
            return function(*args)
        return _CheckpointFunction.apply(function, self._current_options(), *args)

    def non_reentrant_checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        """``torch.utils.checkpoint`` (non-reentrant) with the tracker's RNG streams."""
        run = _replaying_rng(function, self.rng_tracker)
        return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """Recompute ``function(*args)`` in backward: with the configured options once
        :meth:`configure` ran, else with torch's non-reentrant checkpoint. Both replay
        dropout masks, tensor-parallel RNG streams included."""
        if self.configured:
            return self.checkpoint(function, *args)
        return self.non_reentrant_checkpoint(function, *args)

    def _current_options(self) -> _Options:
        opts, group = self.options, self.tp_group
        partition = opts.partition_activations and group is not None
        return _Options(
            partition_group=group if partition and comm.get_world_size(group) > 1 else None,
            to_cpu=opts.cpu_checkpointing,
            synchronize=opts.synchronize_checkpoint_boundary,
            profile=opts.profile,
            tracker=self.rng_tracker,
        )


DEFAULT_CONTEXT = RecomputeContext()
"""The process-wide context behind DeepSpeed's module-level API; a model uses it until an
engine gives it its own (:func:`use_recompute_context_`)."""


def use_recompute_context_(model: nn.Module, context: RecomputeContext) -> int:
    """Make every submodule of ``model`` that recomputes (it declares a ``recompute_context``
    attribute) use ``context``, in place. Returns how many were bound."""
    bound = 0
    for module in model.modules():
        if isinstance(getattr(module, "recompute_context", None), RecomputeContext):
            module.recompute_context = context  # type: ignore[assignment]
            bound += 1
    return bound


def bind_hf_checkpointing_(model: nn.Module, context: RecomputeContext) -> None:
    """Make a Hugging Face model's gradient checkpointing run through ``context``, in place.

    transformers checkpoints each decoder layer with the function set by
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` (torch's
    checkpoint, whose kept inputs stay where they are). After this call that function is
    ``context.run``, whether checkpointing was enabled before (it is rebound now) or is
    enabled later (the model's ``_set_gradient_checkpointing`` is wrapped), so the
    ``activation_checkpointing`` options (``cpu_checkpointing``, ``partition_activations``,
    ``selective``) apply to HF models as they do to ``slipstream.checkpointing.checkpoint``.
    The checkpointing kwargs given to ``gradient_checkpointing_enable`` (``use_reentrant``)
    are superseded. A model that never enables gradient checkpointing is not checkpointed.
    """
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = context.run  # type: ignore[assignment]
    original = getattr(model, "_set_gradient_checkpointing", None)
    if original is None or getattr(original, "_slipstream_bound", False):
        return

    def set_gradient_checkpointing(
        enable: bool = True, gradient_checkpointing_func: Any = None, every_n_layers: int = 1
    ) -> None:
        original(
            enable=enable, gradient_checkpointing_func=context.run, every_n_layers=every_n_layers
        )

    set_gradient_checkpointing._slipstream_bound = True  # type: ignore[attr-defined]
    model._set_gradient_checkpointing = set_gradient_checkpointing  # type: ignore[method-assign, assignment]


def configure(
    mpu_: Any = None,
    deepspeed_config: ActivationCheckpointingConfig | dict[str, Any] | str | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    selective: bool | None = None,
) -> None:
    """Set the options of :func:`checkpoint` (DeepSpeed's signature), on :data:`DEFAULT_CONTEXT`.

    Args:
        mpu_: the tensor-parallel group (a ``ProcessGroup``), or a Megatron-style object with
            ``get_tensor_model_parallel_group()`` (or ``get_model_parallel_group()``); None
            when there is no tensor parallelism.
        deepspeed_config: an ``ActivationCheckpointingConfig``, a whole config (dict or
            path) whose ``activation_checkpointing`` block is read, or that block itself.
        partition_activations ... selective: override single options (None keeps them).
    """
    DEFAULT_CONTEXT.configure(
        mpu_,
        deepspeed_config,
        partition_activations,
        contiguous_checkpointing,
        num_checkpoints,
        checkpoint_in_cpu,
        synchronize,
        profile,
        selective,
    )


def _options_from(config: Any) -> ActivationCheckpointingConfig:
    if config is None:
        return ActivationCheckpointingConfig()
    if isinstance(config, ActivationCheckpointingConfig):
        return config
    raw = load_config(config) if not isinstance(config, dict) else config
    block = raw.get("activation_checkpointing", raw)
    return ActivationCheckpointingConfig.model_validate(block)


def _tp_group_of(mpu: Any) -> comm.Group:
    if mpu is None or comm.is_process_group(mpu):
        return mpu
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    raise TypeError(
        f"configure(mpu_={type(mpu).__name__}): pass the tensor-parallel ProcessGroup or an "
        "object with get_tensor_model_parallel_group()"
    )


def is_configured() -> bool:
    """True once :func:`configure` ran on the default context."""
    return DEFAULT_CONTEXT.configured


def reset() -> None:
    """The default context back to defaults (full recompute, nothing partitioned or offloaded)."""
    DEFAULT_CONTEXT.reset()


def set_num_layers(num_layers: int) -> None:
    """Accepted for compatibility (DeepSpeed sizes a contiguous buffer with it)."""
    DEFAULT_CONTEXT.num_layers = num_layers


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tensor-parallel RNG tracker (DeepSpeed/Megatron name)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default and tensor-parallel RNG streams (DeepSpeed/Megatron name)."""
    model_parallel_manual_seed(seed)


# ----------------------------------------------------------------------------- checkpoint
def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without storing its activations; recompute them in backward.

    Honours the options of :data:`DEFAULT_CONTEXT` (see the module docstring). Tensor outputs
    only (a tensor or a tuple/list of tensors and non-tensors).
    """
    return DEFAULT_CONTEXT.checkpoint(function, *args)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``torch.utils.checkpoint`` (non-reentrant) with the default tracker's RNG streams."""
    return DEFAULT_CONTEXT.non_reentrant_checkpoint(function, *args)


def _replaying_rng(function: Callable[..., Any], tracker: RNGStatesTracker) -> Callable[..., Any]:
    """``function`` whose second and later calls (the recomputes) run with the
    tensor-parallel RNG tracker's streams as they were at the first call."""
    states = _tracker_states(tracker)
    first = [True]

    def run(*inner: Any) -> Any:
        if first[0]:
            first[0] = False
            return function(*inner)
        with _restored_tracker(tracker, states):
            return function(*inner)

    return run


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # An attention kernel with dropout draws random numbers: skipping it in the recompute
    # would shift every later draw (other dropout masks would change), so it is recomputed.
    if op in _SAVE_OPS and _dropout_p(op, args, kwargs) == 0.0:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _dropout_p(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return float(value or 0.0)
    return 0.0


def _selective(function: Callable[..., Any], tracker: RNGStatesTracker, *args: Any) -> Any:
    return torch_checkpoint(
        _replaying_rng(function, tracker),
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls),
    )


def _tracker_states(tracker: RNGStatesTracker) -> dict[str, Any] | None:
    """The tracker's RNG streams now (None: no stream was ever added)."""
    return tracker.get_states() or None


@contextmanager
def _restored_tracker(tracker: RNGStatesTracker, states: dict[str, Any] | None) -> Iterator[None]:
    """Run with the tracker's streams as they were at the first forward; then put back."""
    if states is None:
        yield
        return
    now = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(now)


@dataclass(frozen=True)
class _Options:
    partition_group: comm.Group
    to_cpu: bool
    synchronize: bool
    profile: bool
    tracker: RNGStatesTracker


def _sync(enabled: bool) -> None:
    acc = get_accelerator()
    if enabled and not acc.is_synchronized_device():
        acc.synchronize()


def _device_rng() -> torch.Tensor | None:
    """The accelerator's generator state (None on a CPU: the CPU state is saved anyway)."""
    acc = get_accelerator()
    return acc.get_rng_state() if acc.device_name() != "cpu" else None


def _stash(t: torch.Tensor, opts: _Options) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of ``t`` (flattened slice under partitioning), maybe on the host."""
    shape = tuple(t.shape)
    kept = t.detach()
    if opts.partition_group is not None:
        world, rank = comm.get_world_size(opts.partition_group), comm.get_rank(opts.partition_group)
        flat = kept.reshape(-1)
        per = -(-flat.numel() // world)
        kept = torch.nn.functional.pad(flat, (0, per * world - flat.numel()))[
            rank * per : (rank + 1) * per
        ].clone()
    if opts.to_cpu and kept.device.type != "cpu":
        # Page-locked host buffer: the device-to-host copy runs asynchronously on the current
        # stream (the host never reads it; the recompute's host-to-device copy is queued on
        # the same stream after it). On a CPU the input already is in host memory: kept as is.
        host = torch.empty(kept.shape, dtype=kept.dtype, pin_memory=True)
        kept = host.copy_(kept, non_blocking=True)
    return kept, shape


def _unstash(
    kept: torch.Tensor, shape: tuple[int, ...], device: torch.device, opts: _Options
) -> torch.Tensor:
    t = kept.to(device, non_blocking=True)
    if opts.partition_group is not None:
        world = comm.get_world_size(opts.partition_group)
        full = torch.empty(t.numel() * world, dtype=t.dtype, device=device)
        comm.all_gather_into_tensor(
            full, t.contiguous(), group=opts.partition_group, label="ckpt_gather"
        )
        n = 1
        for s in shape:
            n *= s
        t = full[:n]
    return t.reshape(shape).detach()


class _CheckpointFunction(torch.autograd.Function):
    """Full recompute with the inputs kept partitioned and/or on the host."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], opts: _Options, *args: Any) -> Any:
        _sync(opts.synchronize)
        start = time.perf_counter()
        ctx.function, ctx.opts = function, opts
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = _device_rng()
        ctx.tracker = _tracker_states(opts.tracker)
        with torch.no_grad():
            outputs = function(*args)
        ctx.tensor_index, ctx.devices, ctx.requires, stashed = [], [], [], []
        ctx.inputs = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                kept, shape = _stash(a, opts)
                ctx.tensor_index.append(i)
                ctx.devices.append((a.device, shape))
                ctx.requires.append(a.requires_grad)
                ctx.inputs[i] = None
                stashed.append(kept)
        ctx.save_for_backward(*stashed)
        _sync(opts.synchronize)
        if opts.profile:
            logger.info("checkpointed forward: %.2f ms", 1e3 * (time.perf_counter() - start))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        opts: _Options = ctx.opts
        _sync(opts.synchronize)
        start = time.perf_counter()
        inputs = list(ctx.inputs)
        for i, kept, (device, shape), req in zip(
            ctx.tensor_index, ctx.saved_tensors, ctx.devices, ctx.requires
        ):
            inputs[i] = _unstash(kept, shape, device, opts).requires_grad_(req)
        cpu_now = torch.get_rng_state()
        device_now = _device_rng() if ctx.device_state is not None else None
        torch.set_rng_state(ctx.cpu_state)
        if ctx.device_state is not None:
            get_accelerator().set_rng_state(ctx.device_state)
        try:
            with torch.enable_grad(), _restored_tracker(opts.tracker, ctx.tracker):
                outputs = ctx.function(*inputs)
        finally:
            torch.set_rng_state(cpu_now)
            if device_now is not None:
                get_accelerator().set_rng_state(device_now)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _sync(opts.synchronize)
        if opts.profile:
            logger.info(
                "checkpoint recompute + backward: %.2f ms", 1e3 * (time.perf_counter() - start)
            )
        input_grads = [x.grad if isinstance(x, torch.Tensor) else None for x in inputs]
        return (None, None, *input_grads)
