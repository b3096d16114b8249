"""``PipelineEngine``: runs a pipeline schedule over a ``PipelineModule`` (DeepSpeed's
``PipelineEngine``: ``train_batch`` / ``eval_batch``).

The engine executes this stage's instruction list from :mod:`.schedule`: forwards and
backwards of micro-batch chunks, activations and gradients moving point to point through
:mod:`._p2p`. Gradient accumulation, data-parallel reduction, loss scaling, clipping and the
step stay in the ZeRO optimizer, as in the base ``Engine``; the optimizer steps once per
``train_batch``, after ``gradient_accumulation_steps`` micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.config import ConfigError
from slipstream.config.schema import SlipstreamConfig
from slipstream.data.loader import RepeatingLoader
from slipstream.distributed import comm
from slipstream.parallel.pipeline._p2p import StageChannel
from slipstream.parallel.pipeline.module import PipelineError, PipelineModule
from slipstream.parallel.pipeline.schedule import (
    Instruction,
    Schedule,
    Timeline,
    build_schedule,
    simulate,
)
from slipstream.runtime.engine import Engine
from slipstream.zero import ZeroOptimizer
from slipstream.zero.param import full_shape

__all__ = ["ActivationStats", "PipelineEngine"]


@dataclass
class ActivationStats:
    """Activation memory of this stage during the last ``train_batch``.

    Attributes:
        peak_in_flight: most (micro-batch, chunk) forwards whose backward had not yet run.
        peak_bytes: most bytes of tensors saved for backward (parameters excluded) alive at
            once, measured with ``torch.autograd.graph.saved_tensors_hooks``.
    """

    peak_in_flight: int = 0
    peak_bytes: int = 0
    live_bytes: int = 0
    in_flight: int = 0
    per_unit: dict[tuple[int, int], int] = field(default_factory=dict)

    def start(self, unit: tuple[int, int]) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.per_unit[unit] = 0

    def saved(self, unit: tuple[int, int], nbytes: int) -> None:
        self.per_unit[unit] += nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, unit: tuple[int, int]) -> None:
        self.in_flight -= 1
        self.live_bytes -= self.per_unit.pop(unit, 0)


class PipelineEngine(Engine):
    """Engine for a ``PipelineModule``: use ``train_batch`` (and ``eval_batch``).

    ``forward``/``backward``/``step`` raise ``PipelineError``. Data: an iterator of
    ``(inputs, labels)`` micro-batches; the first stage reads inputs, the last labels, others
    need none. ``train_batch`` reads ``gradient_accumulation_steps`` micro-batches.

    Raises:
        ConfigError: a ``pipeline`` config block that disagrees with the
            module (stages, virtual stages).
    """

    def __init__(
        self,
        module: PipelineModule,
        optimizer: ZeroOptimizer | None,
        lr_scheduler: Any,
        config: SlipstreamConfig,
        mesh: Any,
        device: torch.device,
    ) -> None:
        super().__init__(module, optimizer, lr_scheduler, config, mesh, device)
        self.pipe_module = module
        _check_config(module, config)
        self.pp_group = mesh.get_group("pp")
        self.num_stages = module.num_stages
        self.stage_id = comm.get_rank(self.pp_group)
        if self.stage_id != module.stage_id:
            raise RuntimeError(
                f"rank {comm.get_rank()} is pipeline stage {self.stage_id} in the mesh but "
                f"built the PipelineModule as stage {module.stage_id}: build the module after "
                "init_distributed with the same world"
            )
        interval = config.pipeline.activation_checkpoint_interval
        if interval > 0:
            module.activation_checkpoint_interval = interval
        self.schedule_kind = config.pipeline.schedule
        self.micro_batches = self.gradient_accumulation_steps()
        self.schedule()  # fail at initialize, not at the first batch (e.g. interleaving sizes)
        tp_group = mesh.get_group("tp")
        pipe = config.pipeline
        flags = (("act", pipe.pipe_partitioned), ("grad", pipe.grad_partitioned))
        partitioned = tuple(kind for kind, on in flags if on)
        self.channel = StageChannel(self.pp_group, device, tp_group, partitioned)
        self.activation_stats = ActivationStats()
        self.last_busy_fraction: float | None = None
        """Share of the last ``train_batch`` this rank spent computing (not waiting): host
        time on the CPU, CUDA event time on a GPU."""
        self._allowed = False
        self._data_iter: Iterator[Any] | None = None
        self._batch_fn: Callable[[Any], Any] | None = None
        # One accumulator per shared parameter: (tied key, index in tied_weight_attrs).
        self._tied_grads: dict[tuple[str, int], torch.Tensor] = {}
        self._tied_hooks = [
            p.register_hook(self._tied_hook((key, i)))
            for key in module.tied_groups
            for i, p in enumerate(module.tied_parameters(key))
        ]

    # ---------------------------------------------------------------- DeepSpeed API
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every micro-batch read from the data iterator (before it is
        split into inputs and labels), as DeepSpeed's ``set_batch_fn``."""
        self._batch_fn = fn

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` reads when called without one."""
        self._data_iter = iterator

    def schedule(self, micro_batches: int | None = None, forward_only: bool = False) -> Schedule:
        """The schedule ``train_batch`` (or ``eval_batch``) runs, for inspection."""
        return build_schedule(
            "gpipe" if forward_only else self.schedule_kind,
            self.num_stages,
            micro_batches or self.micro_batches,
            self.pipe_module.virtual_stages,
            forward_only=forward_only,
        )

    def timeline(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
        """The simulated timeline of the configured schedule (``to_text()``,
        ``to_chrome_trace()``, ``bubble_fraction()``); a stage's forward of one micro-batch
        costs ``forward_cost``, its backward ``backward_cost``."""
        return simulate(self.schedule(), forward_cost, backward_cost)

    def bubble_fraction(self) -> float:
        """Idle share of the configured schedule: ``(p-1)/(m+p-1)``, or ``(p-1)/(vm+p-1)``
        interleaved. ``last_busy_fraction`` is the measured counterpart of this rank."""
        return self.timeline().bubble_fraction()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._allowed:
            raise PipelineError(
                "engine.forward() is not available with a PipelineModule: the pipeline runs "
                "forward and backward itself; call engine.train_batch(data_iter) (or "
                "engine.eval_batch(data_iter))"
            )
        return super().forward(*inputs, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        raise PipelineError(
            "engine.backward() is not available with a PipelineModule: call "
            "engine.train_batch(data_iter), which runs forward, backward and step"
        )

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        if not self._allowed:
            raise PipelineError(
                "engine.step() is not available with a PipelineModule: call "
                "engine.train_batch(data_iter), which runs forward, backward and step"
            )
        super().step(lr_kwargs)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Forward and backward ``gradient_accumulation_steps`` micro-batches through the
        pipeline with the configured schedule, then one optimizer step.

        Returns:
            The mean loss over the micro-batches (and data-parallel ranks), the same scalar
            tensor on every rank (broadcast from the last stage).
        Communication: per micro-batch and stage boundary one activation and one gradient
            message (plus a 512-byte header each); the ZeRO reduction as usual; one broadcast
            of the loss over the pipeline group.
        """
        opt = self._require_optimizer()
        self.module.train()
        m = self.micro_batches
        data = self._take(data_iter, m)
        sched = self.schedule(m)
        self.activation_stats = ActivationStats()
        self._tied_grads = {}
        steps = sched.steps[self.stage_id]
        last_backward = max(i for i, x in enumerate(steps) if x.op == "backward")
        run = _Run(self, data, train=True)
        clock = _Clock(self.device)
        for n, ins in enumerate(steps):
            if ins.op == "backward":
                opt.set_gradient_sync(n == last_backward)
            if ins.op in ("forward", "backward"):
                with clock.busy():
                    run.execute(ins)
            else:
                run.execute(ins)
        self.channel.flush()
        self.last_busy_fraction = clock.busy_fraction()
        self._reduce_tied_grads(opt)
        loss = self._mean_loss(run.losses, m)
        assert loss is not None
        self._observe_loss(loss.detach())  # the batch mean, on every rank: no extra traffic
        self._allowed = True
        try:
            self.set_gradient_accumulation_boundary(True)
            self.step()
        finally:
            self._allowed = False
        return loss

    @torch.no_grad()
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default: accumulation steps) micro-batches.

        Args:
            reduce_output: "avg" (the mean over micro-batches) or None (a [micro-batches]
                tensor of per-micro-batch losses); either averaged over data-parallel ranks.
            bcast_loss: send the loss to every stage (else only the last stage has it).
        Returns:
            The loss when ``compute_loss`` and the module has a ``loss_fn`` (None on other
            stages without ``bcast_loss``), else None; with ``return_logits`` a pair
            ``(loss, outputs)`` where ``outputs`` lists the last stage's per-micro-batch
            outputs (None on other stages).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(
                f"eval_batch(reduce_output={reduce_output!r}): use 'avg' (mean over "
                "micro-batches) or None (one loss per micro-batch)"
            )
        self.module.eval()
        m = num_micro_batches or self.micro_batches
        data = self._take(data_iter, m)
        run = _Run(self, data, train=False, compute_loss=compute_loss)
        for ins in self.schedule(m, forward_only=True).steps[self.stage_id]:
            run.execute(ins)
        self.channel.flush()
        loss = None
        if compute_loss and self.pipe_module.loss_fn is not None:
            loss = self._mean_loss(run.losses, m, reduce_output, bcast_loss)
        if return_logits:
            return loss, (run.outputs if self.is_last_stage() else None)
        return loss

    def destroy(self) -> None:
        for h in self._tied_hooks:
            h.remove()
        super().destroy()

    # ---------------------------------------------------------------- internals
    def _take(self, data_iter: Iterator[Any] | None, m: int) -> list[Any]:
        """``m`` micro-batches on the first and last stage (others read nothing).

        Every stage learns whether all got their data (one small all-reduce over the
        pipeline group): a stage whose iterator failed would otherwise leave the others
        waiting forever for its activations. Every rank raises, naming the stage.
        """
        error: PipelineError | None = None
        try:
            data = self._read(data_iter, m)
        except PipelineError as e:
            error, data = e, []
        if self.num_stages > 1:
            flag = torch.tensor([self.stage_id + 1 if error is not None else 0], device=self.device)
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.pp_group, label="pipe_data")
            failed = int(flag.item()) - 1
            if error is None and failed >= 0:
                raise PipelineError(
                    f"pipeline stage {failed} could not read its micro-batches (see its error); "
                    f"stage {self.stage_id} stops too instead of waiting for it"
                )
        if error is not None:
            raise error
        return data

    def _read(self, data_iter: Iterator[Any] | None, m: int) -> list[Any]:
        if not (self.is_first_stage() or self.is_last_stage()):
            return [None] * m
        it = data_iter if data_iter is not None else self._data_iter
        if it is None and self.training_dataloader is not None:
            # initialize(training_data=...): epoch after epoch, as DeepSpeed's engine does
            self._data_iter = it = RepeatingLoader(self.training_dataloader)
        if it is None:
            raise PipelineError(
                f"pipeline stage {self.stage_id} needs data: pass data_iter= (an iterator of "
                "(inputs, labels) micro-batches) or call engine.set_dataiterator(...)"
            )
        out = []
        for i in range(m):
            try:
                batch = next(it)
            except StopIteration:
                raise PipelineError(
                    f"the data iterator ran out after {i} of {m} micro-batches "
                    "(gradient_accumulation_steps): give it enough micro-batches"
                ) from None
            if self._batch_fn is not None:
                batch = self._batch_fn(batch)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise PipelineError(
                    f"a pipeline micro-batch must be an (inputs, labels) pair, got "
                    f"{type(batch).__name__}: yield tuples from the data iterator"
                )
            out.append(_to_device(batch, self.device))
        return out

    def _mean_loss(
        self,
        losses: list[torch.Tensor],
        m: int,
        reduce: str | None = "avg",
        bcast: bool = True,
    ) -> torch.Tensor | None:
        """Mean over micro-batches ("avg"; None keeps one per micro-batch) and data-parallel
        ranks, broadcast from the last stage (``bcast``)."""
        shape = () if reduce == "avg" else (m,)
        total = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            total = torch.stack([x.float() for x in losses])
            total = total.mean() if reduce == "avg" else total
            dp_group = self.optimizer.group if self.optimizer is not None else None
            if dp_group is not None and comm.get_world_size(dp_group) > 1:
                comm.all_reduce(total, group=dp_group, label="pipe_loss")
                total /= comm.get_world_size(dp_group)
        if not bcast:
            return total if self.is_last_stage() else None
        if self.num_stages > 1:
            src = comm.global_rank(self.pp_group, self.num_stages - 1)
            comm.broadcast(total, src=src, group=self.pp_group, label="pipe_loss")
        return total

    def _tied_hook(self, slot: tuple[str, int]) -> Any:
        """Keep a tied copy's gradient out of the ZeRO reducer (it sees zeros) and collect
        it here: it is summed over the stages holding the tied key after the schedule, when every
        stage has finished its backwards (a collective inside backward would deadlock the
        pipeline), then added to the reduced gradient the optimizer reads."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            acc = self._tied_grads.get(slot)
            g = grad.detach().float()
            self._tied_grads[slot] = g.clone() if acc is None else acc.add_(g)
            return torch.zeros_like(grad)

        return hook

    def _reduce_tied_grads(self, opt: ZeroOptimizer) -> None:
        module = self.pipe_module
        dp_size = comm.get_world_size(opt.group)
        for key in sorted(module.tied_groups):
            for i, p in enumerate(module.tied_parameters(key)):
                grad = self._tied_grads.get((key, i))
                if grad is None:
                    # full_*: under ZeRO-3 a released parameter is an empty tensor
                    grad = torch.zeros(full_shape(p), dtype=torch.float32, device=p.device)
                flat = grad.reshape(-1)
                comm.all_reduce(flat, group=module.tied_groups[key], label=f"tied_{key}")
                if dp_size > 1:
                    comm.all_reduce(flat, group=opt.group, label=f"tied_{key}")
                    flat /= dp_size
                if opt.trains(p):  # else frozen: not in the optimizer
                    opt.add_reduced_grad(p, flat)
        self._tied_grads = {}


class _Clock:
    """Compute time against wall time of one ``train_batch``: host timers on the CPU, CUDA
    events on a GPU (whose kernels run asynchronously to the host)."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type != "cpu"
        self.spans: list[tuple[Any, Any]] = []
        self.start = self._mark()

    def _mark(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        event = get_accelerator().Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def busy(self) -> Iterator[None]:
        begin = self._mark()
        yield
        self.spans.append((begin, self._mark()))

    def busy_fraction(self) -> float:
        end = self._mark()
        if self.on_device:
            end.synchronize()
            total = self.start.elapsed_time(end)
            busy = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            total = end - self.start
            busy = sum(b - a for a, b in self.spans)
        return float(busy / max(total, 1e-9))


class _Run:
    """State of one ``train_batch``/``eval_batch``: the executor of instructions."""

    def __init__(
        self, engine: PipelineEngine, data: list[Any], train: bool, compute_loss: bool = True
    ) -> None:
        self.e = engine
        self.module = engine.pipe_module
        self.data = data
        self.train = train
        self.compute_loss = compute_loss
        self.p = engine.num_stages
        self.last_chunk = self.p * self.module.virtual_stages - 1
        self.inputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.outputs_of: dict[tuple[int, int], Any] = {}
        self.grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: list[Any] = []
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.module.parameters()}

    def k(self, ins: Instruction) -> int:
        return self.module.model_chunk(ins.chunk)

    def execute(self, ins: Instruction) -> None:
        getattr(self, "_" + ins.op)(ins)

    # -------------------------------------------------------------- communication
    def _recv_act(self, ins: Instruction) -> None:
        k = self.k(ins)
        tensors, flags = self.e.channel.recv((k - 1) % self.p, ("act", ins.micro_batch, k - 1))
        for t, f in zip(tensors, flags):
            if f and self.train:
                t.requires_grad_(True)
        self.inputs[(ins.micro_batch, ins.chunk)] = tuple(tensors)

    def _send_act(self, ins: Instruction) -> None:
        k = self.k(ins)
        out = self.outputs_of[(ins.micro_batch, ins.chunk)]
        tensors = out if isinstance(out, tuple) else (out,)
        self.e.channel.send(tensors, (k + 1) % self.p, ("act", ins.micro_batch, k))
        if not self.train:
            del self.outputs_of[(ins.micro_batch, ins.chunk)]

    def _recv_grad(self, ins: Instruction) -> None:
        k = self.k(ins)
        tensors, _ = self.e.channel.recv((k + 1) % self.p, ("grad", ins.micro_batch, k + 1))
        self.grads_in[(ins.micro_batch, ins.chunk)] = tensors

    def _send_grad(self, ins: Instruction) -> None:
        k = self.k(ins)
        inputs = self.inputs.pop((ins.micro_batch, ins.chunk))
        grads = tuple(
            t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad
        )
        self.e.channel.send(grads, (k - 1) % self.p, ("grad", ins.micro_batch, k))

    # -------------------------------------------------------------- compute
    def _forward(self, ins: Instruction) -> None:
        unit = (ins.micro_batch, ins.chunk)
        k = self.k(ins)
        if k == 0:
            x = self.data[ins.micro_batch][0]
        else:
            # A copy of what needs a gradient, as DeepSpeed makes: an in-place first layer
            # (ReLU(inplace=True)) may overwrite it; the received leaf keeps the gradient.
            received = tuple(t.clone() if t.requires_grad else t for t in self.inputs[unit])
            x = received if len(received) > 1 else received[0]
        if self.train:
            stats = self.e.activation_stats
            stats.start(unit)

            def pack(t: torch.Tensor) -> torch.Tensor:
                if t.untyped_storage().data_ptr() not in self._param_storages:
                    stats.saved(unit, t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.module.forward_chunk(ins.chunk, x)
        else:
            out = self.module.forward_chunk(ins.chunk, x)
            self.inputs.pop(unit, None)
        if k == self.last_chunk:
            labels = self.data[ins.micro_batch][1]
            if not self.train:
                self.outputs.append(self.module.full_outputs(out))
            loss_fn = self.module.loss_fn
            if loss_fn is not None and (self.train or self.compute_loss):
                out = self.module.compute_loss(out, labels)
            if self.train or (self.compute_loss and loss_fn is not None):
                if not isinstance(out, torch.Tensor) or out.dim() != 0:
                    raise PipelineError(
                        "the last pipeline stage must produce a scalar loss: give "
                        "PipelineModule a loss_fn(outputs, labels) or end with a layer that "
                        "returns the loss"
                    )
                self.losses.append(out.detach())
        self.outputs_of[unit] = out

    def _backward(self, ins: Instruction) -> None:
        unit = (ins.micro_batch, ins.chunk)
        out = self.outputs_of.pop(unit)
        opt = self.e._require_optimizer()
        if self.k(ins) == self.last_chunk:
            factor = opt.loss_scale / self.e.micro_batches
            (out * factor).backward()
        else:
            outs = out if isinstance(out, tuple) else (out,)
            grads = self.grads_in.pop(unit)
            pairs = [(o, g) for o, g in zip([o for o in outs if o.requires_grad], grads)]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        opt.finish_backward()
        self.e.activation_stats.release(unit)


def _check_config(module: PipelineModule, config: SlipstreamConfig) -> None:
    pipe = config.pipeline
    if pipe.partition not in ("best", module.partition_method):
        raise ConfigError(
            f"config key 'pipeline.partition' = {pipe.partition!r}, but the PipelineModule was "
            f"built with partition_method={module.partition_method!r}: make them equal or "
            "use 'best' (the module's)"
        )
    if pipe.seed_layers and not module.seed_layers:
        raise ConfigError(
            "config key 'pipeline.seed_layers' = true, but the PipelineModule was built with "
            "seed_layers=False (its layers are already initialized): pass "
            "PipelineModule(..., seed_layers=True) or set the key to false"
        )
    if pipe.virtual_stages != module.virtual_stages:
        raise ConfigError(
            f"config key 'pipeline.virtual_stages' = {pipe.virtual_stages}, but the "
            f"PipelineModule was built with virtual_stages={module.virtual_stages}: make them "
            "equal (virtual_stages > 1 needs pipeline.schedule 'interleaved')"
        )


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(v, device) for v in x)
    return x
