"""``slipstream.initialize``: read the config, build the components, return the 4-tuple.

This is the thin facade of DESIGN.md: it parses the config once, builds the mesh, applies
``shard_zero_`` and wires optimizer, scheduler and dataloader; the engine only sequences.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.accelerator import get_accelerator
from slipstream.config import AutoContext, ConfigError, SlipstreamConfig
from slipstream.config.loader import read_config, resolve_batch
from slipstream.data.loader import build_dataloader
from slipstream.distributed import comm
from slipstream.distributed.mesh import (
    DeviceMesh,
    ParallelDims,
    build_mesh,
    dp_group,
    dp_sp_group,
)
from slipstream.distributed.topology import resolve_ranks_per_node
from slipstream.moe import agree_expert_groups, expert_parallel_, moe_layers
from slipstream.moe.autoep import autoep_, new_param, remap_params_
from slipstream.parallel.pipeline import PipelineModule
from slipstream.precision import LossScaler, PrecisionPolicy
from slipstream.runtime._foreign import refuse_real_deepspeed
from slipstream.runtime.engine import Engine
from slipstream.runtime.extensions import apply_engine_extensions
from slipstream.runtime.parallelize import axis_group, parallelize_
from slipstream.runtime.pipeline_engine import PipelineEngine
from slipstream.zero import StepPolicy, ZeroOptimizer, estimate_memory, shard_zero_
from slipstream.zero.init import (
    has_meta_parameters,
    is_partitioned_model,
    partition_meta_,
    unpartition_,
)
from slipstream.zero.leaf_modules import apply_leaf_module_config
from slipstream.zero.param import check_not_foreign, full_shape

__all__ = ["initialize"]

OptimizerLike = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: OptimizerLike | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: SlipstreamConfig | dict[str, Any] | str | None = None,
    config_params: SlipstreamConfig | dict[str, Any] | str | None = None,
) -> tuple[Engine, ZeroOptimizer | None, Any, Any]:
    """Prepare ``model`` for training; DeepSpeed's ``deepspeed.initialize``.

    Args:
        args: optional argparse namespace; ``args.deepspeed_config`` is read if ``config``
            is not given.
        model: the module to train (required).
        optimizer: a torch optimizer over the model's parameters, or a callable taking
            parameters and returning one; overrides the config's ``optimizer`` block.
        model_parameters: parameters or param-group dicts to optimize (default: all
            trainable parameters of ``model``).
        training_data: a Dataset; a distributed dataloader of micro-batches is returned,
            shuffled with the config's ``seed`` (DeepSpeed's ``DistributedSampler`` order),
            in order for a ``PipelineModule`` as DeepSpeed's pipeline engine reads it.
        lr_scheduler: a scheduler or a callable taking the optimizer; overrides the config.
        distributed_port: MASTER_PORT when initializing a single process.
        dist_init_required: initialize torch.distributed (None: if not yet initialized).
        collate_fn: collate function for the returned dataloader.
        config: dict, JSON/HJSON path, base64 JSON, or ``SlipstreamConfig``.
    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; dataloader and scheduler may be None.
    Raises:
        ConfigError: bad config (unknown keys, batch sizes, unresolvable "auto", ...).
    """
    if model is None:
        raise ValueError("initialize() needs model=: pass the nn.Module to train")
    refuse_real_deepspeed(model, optimizer, lr_scheduler)
    if mpu is not None and not _is_sequence_parallel_mpu(mpu):
        raise ValueError(
            "mpu= (a Megatron model-parallel unit) is not accepted: slipstream builds its own "
            "process groups from the config (tensor_parallel.autotp_size, a PipelineModule's "
            "num_stages, sequence_parallel_size); remove mpu= (the one mpu accepted is the "
            "sequence-parallel groups module UlyssesSPAttentionHF.register_with_transformers "
            "returns)"
        )
    config = _pick_config(args, config, config_params)
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if dist_init_required is not False:
        comm.init_distributed()
    comm.ensure_control_group()
    check_not_foreign(model.named_parameters())
    if has_meta_parameters(model):  # built in a zero.Init still open, or on meta by hand
        partition_meta_(model)
    # Which ranks share a node: the comm logger splits intra-node from cross-node bytes.
    comm.set_ranks_per_node(resolve_ranks_per_node(comm.get_world_size()))
    client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    # The config is read once; the batch arithmetic waits for the data-parallel size, which
    # the mesh sizes in the same config decide.
    cfg = read_config(config, auto=_auto_context(model, client_opt))
    dims = _parallel_dims(cfg, model)
    if cfg.gradient_allreduce_op == "sum" and dims.sp > 1:
        raise ConfigError(
            "config key 'gradient_allreduce_op' = 'sum' is not supported with "
            f"sequence_parallel_size = {dims.sp}: use 'mean'"
        )
    if mpu is not None:
        _check_sp_mpu(mpu, dims.sp)
    mesh = build_mesh(dims)
    cfg = resolve_batch(cfg, dims.dp)
    group = dp_sp_group(mesh)  # ZeRO shards over every rank holding the same parameters
    device = _device()
    # Pipeline stages hold different layers: compare the model within a stage only.
    _check_ranks_agree(model, cfg, group if dims.pp > 1 else None)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)

    model_dtype = _floating_dtype(model)
    policy = PrecisionPolicy.from_config(
        cfg.fp16, cfg.bf16, cfg.data_types, cfg.communication_data_type, model_dtype
    )
    _place_(model, device, policy.param_dtype)
    parallelize_(model, cfg, mesh)
    if cfg.expert_parallel.enabled:  # AutoEP: HF MoE blocks to expert-parallel experts
        model_parameters = _autoep(model, cfg, mesh, client_opt, model_parameters)
    # MoE: each layer's expert-parallel group from the mesh; ZeRO reduces experts over theirs.
    if dims.pp > 1:  # stages hold different layers; every rank makes every group
        agree_expert_groups(model, mesh)
    experts = expert_parallel_(model, mesh) if moe_layers(model) else None
    groups, make_optimizer = _optimizer_plan(model, optimizer, model_parameters, cfg)
    zero_opt: ZeroOptimizer | None = None
    if cfg.zero_optimization.stage == 3:  # before the model is cut into units
        apply_leaf_module_config(model, cfg.zero_optimization.leaf_module)
    if make_optimizer is not None:
        zero_opt = shard_zero_(
            model,
            group,
            cfg.zero_optimization,
            policy,
            groups,
            make_optimizer,
            _step_policy(cfg, mesh, device),
            device,
            experts,
        )
    elif is_partitioned_model(model):  # no optimizer (inference): gather in full
        unpartition_(model)
    scheduler = _scheduler(lr_scheduler, zero_opt, client_opt, cfg)
    loader = None
    if training_data is not None:
        if dims.sp > 1:  # the sp ranks of a dp rank read the same samples, keep their slice
            from slipstream.sequence import SequenceShardCollate, shard_causal_lm_batch
            from slipstream.sequence.hf import is_hf_attention_model

            # A Hugging Face causal LM: labels shifted on the full sequence, global positions.
            shard: Callable[[Any, int, int], Any] | None = (
                shard_causal_lm_batch if is_hf_attention_model(model) else None
            )
            if cfg.sequence_parallel_mode == "ring":  # the zig-zag layout
                shard = _ring_shard(cfg, is_hf_attention_model(model))
            collate_fn = SequenceShardCollate(mesh.get_group("sp"), collate_fn, shard=shard)
        loader = build_dataloader(
            training_data,
            cfg.batch[1],
            dims.dp,
            comm.get_rank(dp_group(mesh)),
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
            seed=cfg.seed or 0,
            shuffle=not _is_pipeline(model),  # DeepSpeed's pipeline reads in order
        )
    engine = _engine_class(model)(model, zero_opt, scheduler, cfg, mesh, device)
    engine.training_dataloader = loader
    apply_engine_extensions(engine)  # e.g. the hybrid engine (slipstream.rlhf)
    if engine.memory is not None:
        engine.memory.estimator = _memory_estimator(model, cfg, policy, comm.get_world_size(group))
    log_rank0(
        "slipstream: world=%d dp=%d sp=%d tp=%d pp=%d zero_stage=%d dtype=%s batch=%s "
        "(global, micro, accumulation)",
        comm.get_world_size(),
        dims.dp,
        dims.sp,
        dims.tp,
        dims.pp,
        cfg.zero_optimization.stage,
        str(policy.param_dtype).replace("torch.", ""),
        cfg.batch,
    )
    return engine, zero_opt, loader, scheduler


def _ring_shard(cfg: SlipstreamConfig, hf: bool) -> Callable[[Any, int, int], Any]:
    """The batch cut of ring attention: zig-zag, labels shifted first for a HF causal LM."""
    from slipstream.sequence import shard_batch_zigzag, shard_causal_lm_batch_ring

    ring = cfg.sequence_parallel_ring_size or cfg.sequence_parallel_size
    fn = shard_causal_lm_batch_ring if hf else shard_batch_zigzag
    return functools.partial(fn, ring_size=ring)


def _memory_estimator(
    model: nn.Module, cfg: SlipstreamConfig, policy: PrecisionPolicy, world: int
) -> Callable[[int], dict[str, int]]:
    """``zero.estimate_memory`` for this layout, as a function of the optimizer's state
    tensors per parameter (``memory_breakdown`` compares it with what the rank holds)."""
    zero = cfg.zero_optimization
    off_opt, off_param = zero.offload_optimizer, zero.offload_param
    return lambda states: estimate_memory(
        model,
        world,
        zero.stage,
        optimizer_states=states,
        param_dtype=policy.param_dtype,
        master_dtype=policy.master_dtype,
        grad_dtype=policy.grad_accum_dtype,
        hpz_partition_size=zero.zero_hpz_partition_size if zero.stage == 3 else 1,
        offload_optimizer=off_opt.device if off_opt is not None and off_opt.enabled else None,
        offload_param=off_param.device if off_param is not None and off_param.enabled else None,
    )


def _parallel_dims(cfg: SlipstreamConfig, model: nn.Module) -> ParallelDims:
    """Mesh sizes from the config (and a ``PipelineModule``'s stages); dp takes the rest."""
    world = comm.get_world_size()
    stages = _pipeline_stages(model, cfg.pipeline.stages)
    sp, tp = cfg.sequence_parallel_size, cfg.tensor_parallel.autotp_size
    others = sp * tp * stages
    if world % others:
        raise ConfigError(
            f"sequence_parallel_size={sp} x tensor_parallel.autotp_size={tp} x pipeline "
            f"stages={stages} = {others} does not divide the world size {world}: choose sizes "
            "whose product divides the number of processes"
        )
    dp = cfg.data_parallel_size
    if dp is not None and dp * others != world:
        raise ConfigError(
            f"config key 'data_parallel_size' = {dp}, but world {world} / (sp {sp} x tp {tp} "
            f"x pp {stages}) = {world // others}: remove the key (it is derived) or fix it"
        )
    if sp > 1 and cfg.tensor_parallel.sequence_parallel:
        raise ConfigError(
            f"sequence_parallel_size={sp} with tensor_parallel.sequence_parallel: true: both "
            "split the sequence (Ulysses/ring over the sp axis, Megatron-style inside the TP "
            "group). Set tensor_parallel.sequence_parallel to false (sequence_parallel_size "
            "composes with tensor_parallel.autotp_size), or sequence_parallel_size to 1"
        )
    return ParallelDims(world_size=world, sp=sp, tp=tp, pp=stages)


def _is_sequence_parallel_mpu(mpu: Any) -> bool:
    from slipstream.runtime.sequence_parallel import parallel_state_sp

    return mpu is parallel_state_sp


def _check_sp_mpu(mpu: Any, sp: int) -> None:
    """The groups of DeepSpeed's ALST entry point (``UlyssesSPAttentionHF.
    register_with_transformers`` returns them as ``mpu``) must match the config's sp size."""
    size = mpu.get_sequence_parallel_world_size()
    if size != sp:
        raise ConfigError(
            f"mpu= holds sequence-parallel groups of size {size} (from "
            f"register_with_transformers) but config key 'sequence_parallel_size' = {sp}: "
            f"set sequence_parallel_size to {size}"
        )


def _place_(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move ``model`` to ``device`` and the training dtype (a ``zero.Init`` model: its
    buffers, the parameters made outside ``zero.Init`` (a head added after loading) and the
    placeholders of the partitioned ones, whose dtype ZeRO lays their shards out in)."""
    if is_partitioned_model(model):
        for mod in model.modules():
            for key, buf in mod._buffers.items():
                if buf is not None and not buf.is_meta:
                    mod._buffers[key] = buf.to(device)
            for p in mod._parameters.values():  # zero.Init's: the empty placeholders
                if p is not None and not p.is_meta:
                    cast = dtype if p.is_floating_point() else p.dtype
                    p.data = p.data.to(device=device, dtype=cast)
    else:
        model.to(device)
    if _floating_dtype(model) != dtype:
        model.to(dtype)


def _step_policy(cfg: SlipstreamConfig, mesh: DeviceMesh, device: torch.device) -> StepPolicy:
    """The optimizer step's policy (loss scaling, clipping, offload) from the config."""
    off = cfg.zero_optimization.offload_optimizer
    return StepPolicy(
        loss_scaler=LossScaler(cfg.fp16),
        clip=cfg.gradient_clipping,
        prescale_gradients=cfg.prescale_gradients,
        predivide_factor=cfg.gradient_predivide_factor,
        sub_group_size=cfg.zero_optimization.sub_group_size,
        allow_untested_optimizer=cfg.zero_allow_untested_optimizer,
        swap_dir=_swap_dir(cfg, device),
        offload_device=_offload_device(cfg, device),
        pin_memory=bool(off is not None and off.pin_memory),
        tp_group=axis_group(mesh, "tp"),
        pp_group=axis_group(mesh, "pp"),
        gradient_average=cfg.gradient_allreduce_op == "mean",
    )


def _pipeline_stages(model: nn.Module, configured: int | None) -> int:
    """Stages of a ``PipelineModule`` (the config's ``pipeline.stages`` must agree)."""
    if not _is_pipeline(model):
        if configured not in (None, 1):
            raise ConfigError(
                f"config key 'pipeline.stages' = {configured} needs a PipelineModule model "
                f"(got {type(model).__name__}): build the model with slipstream.pipe."
                "PipelineModule(layers=[...], num_stages=...) or remove the key"
            )
        return 1
    if configured is not None and configured != model.num_stages:
        raise ConfigError(
            f"config key 'pipeline.stages' = {configured}, but the PipelineModule was built "
            f'with num_stages={model.num_stages}: make them equal (or set stages to "auto")'
        )
    return int(model.num_stages)  # type: ignore[arg-type]


def _swap_dir(cfg: SlipstreamConfig, device: torch.device) -> str | None:
    """Where optimizer states are swapped (``offload_optimizer``), if anywhere."""
    off = cfg.zero_optimization.offload_optimizer
    if off is None or not off.enabled:
        return None
    if off.device == "cpu":
        return None
    return off.nvme_path


def _offload_device(cfg: SlipstreamConfig, device: torch.device) -> torch.device | None:
    """CPU for ``offload_optimizer.device = "cpu"`` when training runs on an accelerator.

    On a CPU-only run the states are already in host memory, so it is a no-op, unless
    ``SLIPSTREAM_FORCE_CPU_OFFLOAD=1`` (which exercises the offload code path on CPU: separate
    master copies, gradients handed over by copy).
    """
    off = cfg.zero_optimization.offload_optimizer
    if off is None or not off.enabled or off.device != "cpu":
        return None
    if device.type == "cpu" and os.environ.get("SLIPSTREAM_FORCE_CPU_OFFLOAD") != "1":
        log_rank0(
            "offload_optimizer.device='cpu': training runs on the CPU, states are already there"
        )
        return None
    return torch.device("cpu")


def _pick_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError(
            "no config given: pass config= (a dict, a JSON/HJSON path or base64 JSON) or "
            "args with --deepspeed_config"
        )
    return config


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _hidden_size(model: nn.Module) -> int | None:
    """The model config's hidden size, where Hugging Face's integration looks for it."""
    conf = getattr(model, "config", None)
    for c in (conf, getattr(conf, "text_config", None)):
        for attr in ("hidden_size", "n_embd", "d_model"):
            value = getattr(c, attr, None)
            if isinstance(value, int):
                return value
        sizes = getattr(c, "hidden_sizes", None)
        if isinstance(sizes, list | tuple) and sizes:
            return max(sizes)
    return None


def _auto_context(model: nn.Module, client_opt: torch.optim.Optimizer | None) -> AutoContext:
    from slipstream.optim import optimizer_defaults

    hparams: dict[str, Any] = {}
    if client_opt is not None:
        hparams = {k: v for k, v in client_opt.param_groups[0].items() if k != "params"}
    return AutoContext(
        hidden_size=_hidden_size(model),
        model_dtype=_floating_dtype(model),
        optimizer_defaults=optimizer_defaults,
        client_hparams=hparams,
    )


def _is_pipeline(model: nn.Module) -> bool:
    return isinstance(model, PipelineModule)


def _engine_class(model: nn.Module) -> type[Engine]:
    return PipelineEngine if _is_pipeline(model) else Engine


def _autoep(
    model: nn.Module,
    cfg: SlipstreamConfig,
    mesh: DeviceMesh,
    client_opt: torch.optim.Optimizer | None,
    model_parameters: Iterable[Any] | None,
) -> Iterable[Any] | None:
    """Convert the HF MoE blocks (``expert_parallel``) and point a client optimizer and
    ``model_parameters`` given before at the new parameters, as DeepSpeed remaps them."""
    replaced = autoep_(model, cfg.expert_parallel, mesh)
    if client_opt is not None:
        if any(len(s) for s in client_opt.state.values()):
            log_rank0("AutoEP replaced expert parameters: the client optimizer's state is reset")
        remap_params_(client_opt.param_groups, replaced)
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g) for g in items]
        remap_params_(groups, replaced)
        return groups
    return [new_param(replaced, p) for p in items]


def _check_ranks_agree(model: nn.Module, cfg: SlipstreamConfig, group: comm.Group) -> None:
    """Fail fast (instead of hanging in a collective) if ranks built different things."""
    shapes = [(n, tuple(full_shape(p)), str(p.dtype)) for n, p in model.named_parameters()]
    comm.check_same_across_ranks(shapes, "model (parameter names, shapes and dtypes)", group)
    comm.check_same_across_ranks(
        json.dumps(cfg.model_dump(), sort_keys=True, default=str), "config"
    )


def _optimizer_plan(
    model: nn.Module,
    optimizer: OptimizerLike | None,
    model_parameters: Iterable[Any] | None,
    cfg: SlipstreamConfig,
) -> tuple[list[dict[str, Any]], Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None]:
    """Param groups and a factory that builds the inner optimizer over master tensors."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            log_rank0("a client optimizer was passed: the config's 'optimizer' block is not used")
        client = optimizer
        groups = [dict(g) for g in client.param_groups]

        def retarget(new_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            # Keep the user's optimizer object (and schedulers bound to it): point its
            # param groups at the master tensors and start from empty state.
            if any(len(s) for s in client.state.values()):
                log_rank0("the client optimizer had state; it is reset for the sharded masters")
            for g, ng in zip(client.param_groups, new_groups):
                g["params"] = ng["params"]
            client.state.clear()
            return client

        return groups, retarget
    if model_parameters is not None:
        items = list(model_parameters)
        groups = (
            [dict(g) for g in items]
            if items and isinstance(items[0], dict)
            else [{"params": items}]
        )
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if callable(optimizer):
        factory = optimizer
        return groups, lambda new_groups: factory(new_groups)
    if cfg.optimizer is None:
        return groups, None
    from slipstream.optim import build_optimizer

    opt_cfg = cfg.optimizer
    build_optimizer(
        opt_cfg.type, opt_cfg.params, [torch.zeros(1, requires_grad=True)]
    )  # validate early
    # On an accelerator the masters live there or, offloaded, in host memory next to it: both
    # get the fused kernel, as DeepSpeed's FusedAdam/CPUAdam. CPU-only training keeps torch's
    # default loop, which the single-process references of the parity tests use too.
    fused = _device().type != "cpu"
    return groups, lambda new_groups: build_optimizer(
        opt_cfg.type, opt_cfg.params, new_groups, prefer_fused=fused
    )


def _scheduler(
    lr_scheduler: Any,
    zero_opt: ZeroOptimizer | None,
    client_opt: torch.optim.Optimizer | None,
    cfg: SlipstreamConfig,
) -> Any:
    if zero_opt is None:
        if lr_scheduler is not None or cfg.scheduler is not None:
            raise ConfigError(
                "a scheduler needs an optimizer: add an 'optimizer' block or pass optimizer="
            )
        return None
    inner = zero_opt.optimizer
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(inner)
        bound = getattr(lr_scheduler, "optimizer", None)
        if bound is not None and bound is not inner and bound is not client_opt:
            raise ValueError(
                "lr_scheduler is bound to an optimizer other than the one passed to "
                "initialize(): build it on that optimizer, or pass a callable"
            )
        if cfg.scheduler is not None:
            log_rank0(
                "a client lr_scheduler was passed: the config's 'scheduler' block is not used"
            )
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    from slipstream.optim import build_scheduler

    return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, inner)
