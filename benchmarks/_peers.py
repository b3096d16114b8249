"""The frameworks measured side by side: DDP, FSDP2, DeepSpeed ZeRO-0/1/2, slipstream ZeRO-0/1/2.

Every peer trains the same model with the same optimizer: AdamW, lr 1e-3, weight decay 0,
PyTorch's default AdamW implementation (DeepSpeed is told ``torch_adam: true`` so it does not
build its FusedAdam kernel). DeepSpeed runs on CPU without compiling any op; the recipe is in
``benchmarks/README.md`` and in :func:`_prepare_deepspeed`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._harness import BenchConfig, Trainer

__all__ = ["PEERS", "Peer", "reference_for"]

_LR = 1e-3
_WEIGHT_DECAY = 0.0
_DEEPSPEED_MIN = (0, 15)


@dataclass(frozen=True)
class Peer:
    """A framework under test (implements ``benchmarks._harness.Framework``)."""

    build_fn: Callable[[nn.Module, BenchConfig], Trainer]
    """Wraps the model and creates the optimizer (on every rank)."""
    prepare_fn: Callable[[BenchConfig], None] | None = None
    """Imports the framework before the memory baseline (on every rank)."""
    unavailable_fn: Callable[[], str | None] | None = None
    """Says why the framework cannot run here (in the parent), or None."""
    interleaved: bool = False
    """The row measures a feature's cost: ``build`` returns a ``Switchable`` trainer and the
    feature is turned off and on in one world (``benchmarks._harness.run_interleaved``)."""

    def prepare(self, cfg: BenchConfig) -> None:
        if self.prepare_fn is not None:
            self.prepare_fn(cfg)

    def build(self, model: nn.Module, cfg: BenchConfig) -> Trainer:
        return self.build_fn(model, cfg)

    def unavailable(self) -> str | None:
        """Why this peer cannot run here (checked in the parent), or None."""
        return self.unavailable_fn() if self.unavailable_fn is not None else None


class _TorchTrainer:
    """Plain PyTorch step: autocast forward, backward, AdamW step, zero grads."""

    def __init__(self, model: nn.Module, cfg: BenchConfig) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=_WEIGHT_DECAY)
        self._device_type = cfg.device
        self._bf16 = cfg.bf16

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        autocast = torch.autocast(self._device_type, dtype=torch.bfloat16, enabled=self._bf16)
        with autocast:
            loss = self.model(input_ids, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class _EngineTrainer:
    """DeepSpeed-shaped step: ``loss = engine(x, y); engine.backward(loss); engine.step()``."""

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.engine = engine
        self.optimizer = optimizer

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.engine(input_ids, labels)
        self.engine.backward(loss)
        self.engine.step()
        return loss


class _MonitorSwitchTrainer(_EngineTrainer):
    """An engine whose monitors are switched off and on between steps: off swaps in a
    ``MonitorMaster`` with no monitor, which is what a config without monitor blocks builds.
    Switching off first flushes, so the events still queued are charged to the "on" block."""

    def __init__(self, engine: Any, optimizer: Any) -> None:
        super().__init__(engine, optimizer)
        self._monitor = engine.monitor
        self._no_monitor = type(engine.monitor)()

    def set_variant(self, on: bool) -> None:
        if not on and self.engine.monitor is self._monitor:
            self._monitor.flush()
        self.engine.monitor = self._monitor if on else self._no_monitor


# --------------------------------------------------------------------------- torch-native


def _build_ddp(model: nn.Module, cfg: BenchConfig) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if cfg.device == "cuda" else None
    cap_mb = cfg.bucket * 4 / 2**20  # DDP sizes buckets in MiB of the gradient dtype
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=cap_mb)
    return _TorchTrainer(ddp, cfg)


def _build_fsdp2(model: nn.Module, cfg: BenchConfig, *, reshard_after_forward: bool) -> Trainer:
    """``fully_shard`` each transformer block, then the root (the torchtitan recipe).

    ``reshard_after_forward=False`` keeps the gathered parameters between forward and
    backward, which is the ZeRO-2-like variant (params all-gathered once per step).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(cfg.device, (cfg.world,))
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.bf16 else None,
        reduce_dtype=torch.float32 if cfg.bf16 else None,
    )
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    for block in _transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # Mixed precision is FSDP's job here; autocast on top would double-cast.
    return _TorchTrainer(model, replace(cfg, bf16=False))


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.layers`` if present, else the children of the largest ModuleList."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to shard")
    return list(max(lists, key=len))


# --------------------------------------------------------------------------- engines


def _engine_config(cfg: BenchConfig, stage: int, optimizer_params: dict[str, Any]) -> dict:
    """The DeepSpeed JSON config both DeepSpeed and slipstream are given.

    ``gradient_clipping`` is pinned to 0 because DeepSpeed 0.19.8 defaults it to 1.0 (0.18.0
    and earlier default to 0) while the torch-native peers do not clip; clipping would change the losses (no parity check)
    and add a norm all-reduce to the step.
    """
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": _LR, "weight_decay": _WEIGHT_DECAY, **optimizer_params},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": cfg.bucket,
            "overlap_comm": True,
        },
        "bf16": {"enabled": cfg.bf16},
    }


def _deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "not installed; pip install -e '.[bench]'"
    version = importlib.metadata.version("deepspeed")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < _DEEPSPEED_MIN:
        return f"deepspeed {version} < 0.15; pip install -U 'deepspeed>=0.15'"
    return None


def _prepare_deepspeed(cfg: BenchConfig) -> None:
    """Import DeepSpeed for a CPU (gloo) or CUDA world without compiling any op.

    ``DS_ACCELERATOR=cpu`` selects DeepSpeed's CPU accelerator (gloo backend, since oneCCL is
    not installed). Its ``TorchBackend`` JIT-compiles a shared-memory all-reduce op
    (``deepspeed_shm_comm``, needs g++) that only ``inference_all_reduce`` uses, so we replace
    ``build_shm_op`` with a stub returning None, DeepSpeed's own "op not available" value.
    """
    os.environ["DS_ACCELERATOR"] = cfg.device
    try:
        deepspeed = importlib.import_module("deepspeed")
        ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    except Exception as exc:
        raise RuntimeError(f"deepspeed unavailable ({type(exc).__name__}: {exc})") from exc
    ds_torch_backend.build_shm_op = lambda: None
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend())


def _build_deepspeed(model: nn.Module, cfg: BenchConfig, *, stage: int) -> Trainer:
    import deepspeed

    config = _engine_config(cfg, stage, {"torch_adam": True})
    config.update(steps_per_print=10**9, wall_clock_breakdown=False)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return _EngineTrainer(engine, optimizer)


def _slipstream_unavailable() -> str | None:
    try:
        slipstream = importlib.import_module("slipstream")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if not hasattr(slipstream, "initialize"):
        return "slipstream.initialize is not implemented yet"
    return None


def _prepare_slipstream(cfg: BenchConfig) -> None:
    importlib.import_module("slipstream")


def _build_slipstream(
    model: nn.Module, cfg: BenchConfig, *, stage: int, monitors: bool = False
) -> Trainer:
    """``monitors``: TensorBoard and CSV monitors on (into a temporary directory), to measure
    what writing the per-step events costs; the trainer can switch them off and on."""
    import tempfile

    import slipstream

    config = _engine_config(cfg, stage, {})
    if monitors:  # one directory every rank agrees on (the configs must be equal)
        out = os.path.join(
            tempfile.gettempdir(), f"slipstream-bench-monitors-{os.environ.get('MASTER_PORT')}"
        )
        config["tensorboard"] = {"enabled": True, "output_path": out, "job_name": "tb"}
        config["csv_monitor"] = {"enabled": True, "output_path": out, "job_name": "csv"}
    engine, optimizer, _, _ = slipstream.initialize(model=model, config=config)
    return (_MonitorSwitchTrainer if monitors else _EngineTrainer)(engine, optimizer)


# --------------------------------------------------------------------------- registry


PEERS: dict[str, Peer] = {
    "ddp": Peer(_build_ddp),
    "fsdp2": Peer(partial(_build_fsdp2, reshard_after_forward=True)),
    "fsdp2-noreshard": Peer(partial(_build_fsdp2, reshard_after_forward=False)),
    **{
        f"deepspeed-z{stage}": Peer(
            partial(_build_deepspeed, stage=stage), _prepare_deepspeed, _deepspeed_unavailable
        )
        for stage in (0, 1, 2, 3)
    },
    **{
        f"slipstream-z{stage}": Peer(
            partial(_build_slipstream, stage=stage), _prepare_slipstream, _slipstream_unavailable
        )
        for stage in (0, 1, 2, 3)
    },
    "slipstream-z2-monitors": Peer(
        partial(_build_slipstream, stage=2, monitors=True),
        _prepare_slipstream,
        _slipstream_unavailable,
        interleaved=True,
    ),
}
"""Every framework the benchmark knows, by its ``--frameworks`` name."""


def reference_for(name: str) -> str | None:
    """The DeepSpeed row a slipstream row is compared with (``slipstream-z1`` -> ``deepspeed-z1``)."""
    prefix = "slipstream-"
    if not name.startswith(prefix):
        return None
    peer = PEERS.get(name)
    if peer is not None and peer.interleaved:  # compared with itself, the feature off
        return None
    return "deepspeed-" + name[len(prefix) :]
