"""FLOPs profiler (DeepSpeed's ``flops_profiler``): parameters, MACs, FLOPs and latency of
every module of a model, forward and backward, and the model FLOPs utilisation (MFU).

Counting works on the aten operators a step really runs (a ``TorchDispatchMode``), so it sees
functional calls, SDPA and custom modules alike, and attributes each operator to every module
active when it ran (``torch.utils.module_tracker``: forward and backward). What is counted:

- matrix products, convolutions and scaled-dot-product attention: PyTorch's own formulas
  (``torch.utils.flop_counter``), 2 FLOPs per multiply-accumulate, so MACs = FLOPs / 2;
- elementwise arithmetic (add, mul, div, pow, rsqrt, exp, activations and their backward):
  1 FLOP per output element; reductions (sum, mean, amax): 1 FLOP per input element;
  softmax and log-softmax: 5 per element; layer norm: 5 per element (forward), 8 (backward);
  none of these are multiply-accumulates;
- data movement (views, copies, cat, embedding look-ups, indexing) and the NLL gather: 0.

Training MFU = (forward + backward FLOPs of a step) / step time / peak device FLOP/s. The peak
comes from the accelerator data sheets (``slipstream.accelerator.peaks``), or on a CPU from a
short measured matmul.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)
from torch.utils.module_tracker import ModuleTracker

from slipstream.accelerator import get_accelerator
from slipstream.accelerator.peaks import data_sheet_peak

__all__ = [
    "FlopsProfiler",
    "ModuleProfile",
    "device_peak_flops",
    "get_model_profile",
    "number_to_string",
]

aten = torch.ops.aten


# --------------------------------------------------------------------------- cost rules
def _numel(x: Any) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def _first_tensor(args: Sequence[Any]) -> Any:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _out_numel(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, list | tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0].numel()
    return 0


def _cpu_sdpa_forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(q.shape, k.shape, v.shape))


def _cpu_sdpa_backward(grad: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))


# The CPU flash-attention kernels are missing from torch's registry (it has the CUDA ones).
_EXTRA_MATMUL: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_sdpa_backward,
}

_POINTWISE = {
    aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.sub.Tensor, aten.sub.Scalar,
    aten.rsub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.div.Tensor,
    aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
    aten.reciprocal.default, aten.addcmul.default, aten.addcdiv.default, aten.lerp.Scalar,
    aten.silu.default, aten.silu_backward.default, aten.gelu.default,
    aten.gelu_backward.default, aten.relu.default, aten.threshold_backward.default,
    aten.tanh.default, aten.tanh_backward.default, aten.sigmoid.default,
    aten.sigmoid_backward.default, aten.native_dropout.default,
    aten.native_dropout_backward.default, aten.where.self, aten.maximum.default,
    aten.minimum.default,
}  # fmt: skip
_REDUCTIONS = {
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.amax.default, aten.var_mean.correction,
}  # fmt: skip
_PER_ELEMENT = {
    aten._softmax.default: 5,
    aten._log_softmax.default: 5,
    aten._softmax_backward_data.default: 5,
    aten._log_softmax_backward_data.default: 5,
    aten.native_layer_norm.default: 5,
    aten.native_layer_norm_backward.default: 8,
}


def op_cost(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(FLOPs, MACs) of one aten call under the rules in the module docstring."""
    packet = func
    extra = _EXTRA_MATMUL.get(func)
    if extra is not None:
        flops = extra(*args)
        return flops, flops // 2
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        flops = int(formula(*args, out_val=out, **kwargs))  # shape_wrapper-ed by torch
        return flops, flops // 2
    if packet in _POINTWISE:
        return _out_numel(out), 0
    if packet in _REDUCTIONS:
        return _numel(_first_tensor(args)), 0
    per = _PER_ELEMENT.get(packet)
    if per is not None:
        return per * _numel(_first_tensor(args)), 0
    return 0, 0


# --------------------------------------------------------------------------- counting
@dataclass
class _Counts:
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    macs: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class _Counter(TorchDispatchMode):
    """Adds each operator's cost to every module active when it runs."""

    def __init__(self, tracker: ModuleTracker, counts: _Counts) -> None:
        super().__init__()
        self.tracker = tracker
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flops, macs = op_cost(func, args, kwargs or {}, out)
        if flops:
            for name in {*self.tracker.parents, "Global"}:
                self.counts.flops[name] += flops
                self.counts.macs[name] += macs
        return out


@dataclass
class ModuleProfile:
    """One module's share of a profiled pass."""

    name: str
    """Dotted name as in ``model.named_modules()`` ("" is the model itself)."""
    type: str
    depth: int
    params: int
    forward_flops: int
    forward_macs: int
    backward_flops: int
    forward_latency_s: float
    """Forward wall time (a module called several times: the sum)."""


class FlopsProfiler:
    """Profile a model's modules: parameters, FLOPs/MACs (forward and backward) and forward
    latency. DeepSpeed's ``FlopsProfiler`` API.

    Example::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(x).sum()
        prof.stop_profile()          # forward counted; backward counts while started
        flops = prof.get_total_flops()
        prof.print_model_profile()
        prof.end_profile()
    """

    def __init__(
        self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._tracker: ModuleTracker | None = None
        self._counter: _Counter | None = None
        self._forward = _Counts()
        self._backward = _Counts()
        self._latency: dict[nn.Module, float] = defaultdict(float)
        self._hooks: list[Any] = []
        self._ignored: tuple[type[nn.Module], ...] = ()

    # ------------------------------------------------------------------ lifecycle
    def start_profile(self, ignore_list: Iterable[type[nn.Module]] | None = None) -> None:
        """Count from now on: the next forward (and a backward while still started)."""
        if self.started:
            return
        self._ignored = tuple(ignore_list or ())
        self._tracker = ModuleTracker()
        # Name modules as named_modules() does, whatever wrapper calls the model first.
        known = getattr(self._tracker, "_known_modules", None)
        if isinstance(known, dict):
            for name, module in self.model.named_modules():
                known[module] = self._key(name)
        self._tracker.__enter__()
        self._counter = _Counter(self._tracker, _Counts())
        self._counter.__enter__()
        torch.zeros(1) + 1  # the first dispatch imports torch._dynamo: not in any module's time
        self._counter.counts = self._forward
        self._add_timing_hooks()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting (the counts stay until ``reset_profile`` / ``end_profile``)."""
        if not self.started:
            return
        assert self._counter is not None and self._tracker is not None
        self._counter.__exit__(None, None, None)
        self._tracker.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.started = False

    def backward_phase(self) -> None:
        """Attribute what runs from now on to the backward pass (the engine calls it)."""
        if self._counter is not None:
            self._counter.counts = self._backward

    def reset_profile(self) -> None:
        self._forward, self._backward = _Counts(), _Counts()
        self._latency.clear()
        if self._counter is not None:
            self._counter.counts = self._forward

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset_profile()

    def _add_timing_hooks(self) -> None:
        starts: dict[nn.Module, list[float]] = defaultdict(list)
        sync = _synchronizer(self.model)

        def pre(module: nn.Module, *_: Any) -> None:
            sync()
            starts[module].append(time.perf_counter())

        def post(module: nn.Module, *_: Any) -> None:
            sync()
            if starts[module]:
                self._latency[module] += time.perf_counter() - starts[module].pop()

        for module in self.model.modules():
            self._hooks.append(module.register_forward_pre_hook(pre))
            self._hooks.append(module.register_forward_hook(post))

    # ------------------------------------------------------------------ results
    def _key(self, name: str) -> str:
        root = type(self.model).__name__
        return root if not name else f"{root}.{name}"

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the profiled pass(es)."""
        total = self._forward.flops.get("Global", 0)
        return number_to_string(total, "FLOPs") if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        total = self._forward.macs.get("Global", 0)
        return number_to_string(total, "MACs") if as_string else total

    def get_total_backward_flops(self) -> int:
        return self._backward.flops.get("Global", 0)

    def get_total_params(self, as_string: bool = False) -> int | str:
        total = _params(self.model)
        return number_to_string(total, "") if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward wall time of the model (seconds)."""
        total = self._latency.get(self.model, 0.0)
        return _seconds(total) if as_string else total

    def module_profiles(self) -> list[ModuleProfile]:
        """Every module (not of an ignored type), in ``named_modules`` order. A container
        that is never called itself (``ModuleList``) gets the sums of its children."""
        named = list(self.model.named_modules())
        flops = {m: self._forward.flops.get(self._key(n), 0) for n, m in named}
        macs = {m: self._forward.macs.get(self._key(n), 0) for n, m in named}
        back = {m: self._backward.flops.get(self._key(n), 0) for n, m in named}
        latency = {m: self._latency.get(m, 0.0) for _, m in named}
        for _, module in reversed(named):  # children before parents
            if module in self._latency or not any(True for _ in module.children()):
                continue
            children = list(module.children())
            flops[module] = sum(flops[c] for c in children)
            macs[module] = sum(macs[c] for c in children)
            back[module] = sum(back[c] for c in children)
            latency[module] = sum(latency[c] for c in children)
        out = []
        for name, module in named:
            if self._ignored and isinstance(module, self._ignored):
                continue
            out.append(
                ModuleProfile(
                    name=name,
                    type=type(module).__name__,
                    depth=0 if not name else name.count(".") + 1,
                    params=_params(module),
                    forward_flops=flops[module],
                    forward_macs=macs[module],
                    backward_flops=back[module],
                    forward_latency_s=latency[module],
                )
            )
        return out

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        step_latencies: dict[str, float] | None = None,
        peak_flops: float | None = None,
    ) -> str:
        """Print (or write to ``output_file``) the summary, the top modules per depth and,
        with ``detailed``, the module tree down to ``module_depth`` (-1: all)."""
        text = format_profile(
            self, profile_step, module_depth, top_modules, detailed, step_latencies, peak_flops
        )
        if output_file:
            with open(output_file, "w") as fp:
                fp.write(text)
        else:
            _write(sys.stdout, text)
        return text


def _write(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


def _params(module: nn.Module) -> int:
    """Parameters of ``module`` and its children (ZeRO-3 shards count at their full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def _synchronizer(model: nn.Module) -> Callable[[], None]:
    if any(p.device.type != "cpu" for p in model.parameters()):
        return get_accelerator().synchronize
    return lambda: None


# --------------------------------------------------------------------------- formatting
def number_to_string(value: float, unit: str, precision: int = 2) -> str:
    """``1.23 G{unit}`` style, as DeepSpeed prints."""
    for threshold, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.{precision}f} {prefix}{unit}".rstrip()
    return (
        f"{value:.{precision}f} {unit}".rstrip()
        if isinstance(value, float)
        else f"{value} {unit}".rstrip()
    )


def _seconds(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def format_profile(
    prof: FlopsProfiler,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
    step_latencies: dict[str, float] | None,
    peak_flops: float | None,
) -> str:
    """The profile as text: summary, top modules per depth, module tree."""
    fwd = int(prof.get_total_flops())
    bwd = prof.get_total_backward_flops()
    params = int(prof.get_total_params())
    lines = [
        "-------------------------- slipstream FLOPs profiler --------------------------",
        f"Profile summary at step {profile_step}:",
        f"params:                                  {number_to_string(params, '')}",
        f"fwd MACs:                                {prof.get_total_macs(as_string=True)}",
        f"fwd FLOPs:                               {number_to_string(fwd, 'FLOPs')}",
    ]
    if bwd:
        lines.append(f"bwd FLOPs (counted):                     {number_to_string(bwd, 'FLOPs')}")
    lat = step_latencies or {}
    fwd_s = lat.get("forward", float(prof.get_total_duration()))
    lines.append(f"fwd latency:                             {_seconds(fwd_s)}")
    if fwd_s:
        lines.append(
            f"fwd FLOPS:                               {number_to_string(fwd / fwd_s, 'FLOPS')}"
        )
    if lat.get("backward"):
        bwd_flops = bwd or 2 * fwd
        lines.append(f"bwd latency:                             {_seconds(lat['backward'])}")
        lines.append(
            f"bwd FLOPS:                               "
            f"{number_to_string(bwd_flops / lat['backward'], 'FLOPS')}"
        )
    if "step" in lat:
        lines.append(f"step latency:                            {_seconds(lat['step'])}")
    iteration = sum(lat.get(k, 0.0) for k in ("forward", "backward", "step"))
    if iteration:
        total = training_flops(fwd, bwd, prof.recompute_fwd_factor)
        lines.append(f"iter latency:                            {_seconds(iteration)}")
        lines.append(
            f"FLOPS per device (fwd+bwd / iter):       {number_to_string(total / iteration, 'FLOPS')}"
        )
        if peak_flops:
            lines.append(
                f"MFU (of {number_to_string(peak_flops, 'FLOPS')} peak):"
                f"{' ' * 8}{100 * total / iteration / peak_flops:.2f}%"
            )
    profiles = prof.module_profiles()
    lines += ["", _top_modules(profiles, module_depth, top_modules)]
    if detailed:
        lines += ["", "Module tree (params, fwd MACs, fwd FLOPs, fwd latency, share of FLOPs):"]
        for p in profiles:
            if module_depth != -1 and p.depth > module_depth:
                continue
            label = p.name or type(prof.model).__name__
            lines.append(
                f"{'  ' * p.depth}{label} ({p.type}): {number_to_string(p.params, '')} params, "
                f"{number_to_string(p.forward_macs, 'MACs')}, "
                f"{number_to_string(p.forward_flops, 'FLOPs')}, {_seconds(p.forward_latency_s)}, "
                f"{_share(p.forward_flops, fwd)}"
            )
    lines.append("-" * 78)
    return "\n".join(lines) + "\n"


def _top_modules(profiles: list[ModuleProfile], module_depth: int, top: int) -> str:
    by_depth: dict[int, list[ModuleProfile]] = defaultdict(list)
    for p in profiles:
        by_depth[p.depth].append(p)
    lines = [f"Top {top} modules per depth (by fwd FLOPs / params / fwd latency):"]
    for depth in sorted(by_depth):
        if module_depth != -1 and depth > module_depth:
            break
        group = by_depth[depth]

        def pick(key: Callable[[ModuleProfile], float], group: list[ModuleProfile] = group) -> str:
            return ", ".join(p.name or p.type for p in sorted(group, key=key, reverse=True)[:top])

        lines.append(
            f"depth {depth}: flops [{pick(lambda p: p.forward_flops)}] "
            f"params [{pick(lambda p: p.params)}] latency [{pick(lambda p: p.forward_latency_s)}]"
        )
    return "\n".join(lines)


def training_flops(forward: int, backward: int, recompute_fwd_factor: float = 0.0) -> float:
    """FLOPs of one training pass: counted backward (or 2 x forward when it was not
    profiled) plus ``recompute_fwd_factor`` x forward for activation recomputation."""
    return forward * (1 + recompute_fwd_factor) + (backward or 2 * forward)


# --------------------------------------------------------------------------- peak FLOP/s
def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of ``device`` in ``dtype``: the data-sheet number for known accelerators
    (``slipstream.accelerator.peaks``, the table the planner's profiles read too), a measured
    matmul rate on CPU (cached), None when unknown."""
    if device.type == "cuda":
        return data_sheet_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return _measured_cpu_peak(dtype)
    return None


@functools.cache
def _measured_cpu_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """The best rate of an n x n x n matmul over a few runs (FLOPs = 2 n^3)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# --------------------------------------------------------------------------- one call
def _deepspeed_number(value: float, precision: int = 2) -> str:
    """A count as DeepSpeed's ``get_model_profile`` returns it: ``"6.27 K"``, ``"808"``."""
    for threshold, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if value >= threshold:
            return f"{round(value / threshold, precision):g} {prefix}"
    return f"{round(value, precision):g} "


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type[nn.Module]] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """Profile one forward (or ``generate``) call of ``model``; DeepSpeed's function, also at
    DeepSpeed's import path ``deepspeed.profiling.flops_profiler``.

    Give ``input_shape`` (a random tensor of that shape, in the model's dtype and on its
    device, is the only argument) or ``args`` / ``kwargs``. As DeepSpeed does, the model is put
    in eval mode (and left there) and called ``warm_up`` times before the profiled call.

    Returns:
        ``(flops, macs, params)`` of the forward pass; with ``as_string`` as DeepSpeed formats
        them: ``("6.27 K", "3.07 KMACs", "808")``.
    """
    kwargs = dict(kwargs or {})
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile(mode={mode!r}): use 'forward' or 'generate'")
    model.eval()
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("get_model_profile: give input_shape or args/kwargs, not both")
        first = next(model.parameters(), None)
        like = torch.ones(()) if first is None else first
        args = (like.new_empty(tuple(input_shape)).normal_(),)
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs for the call")
    call: Callable[..., Any] = model
    if mode == "generate":
        call = getattr(model, "generate", None)  # type: ignore[assignment]
        if not callable(call):
            raise ValueError(
                f"get_model_profile(mode='generate'): {type(model).__name__} has no generate"
            )
    with torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        call(*args, **kwargs)
        prof.stop_profile()
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.end_profile()
    if as_string:
        return (
            _deepspeed_number(int(flops)),
            _deepspeed_number(int(macs)) + "MACs",
            _deepspeed_number(int(params)).replace("G", "B").strip(),
        )
    return flops, macs, params
