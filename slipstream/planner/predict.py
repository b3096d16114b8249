"""``predict(model, hardware, layout)``: per-rank memory and step time of one layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.planner.flops import model_flops, step_flops
from slipstream.planner.hardware import Hardware
from slipstream.planner.layout import Layout, check_layout
from slipstream.planner.memory import PredictedMemory, predict_memory
from slipstream.planner.model import ModelSpec
from slipstream.planner.timing import StepTime, predict_step_time

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` returns: the layout, its memory and time, and the derived rates."""

    model: ModelSpec
    hardware: Hardware
    layout: Layout
    memory: PredictedMemory
    time: StepTime
    hardware_flops: float
    """FLOPs executed per step, recomputation included (Megatron's 96/72 convention)."""
    model_flops: float
    """FLOPs the model needs per step, recomputation excluded."""

    @property
    def step_time_s(self) -> float:
        return self.time.step_time_s

    @property
    def memory_per_rank_bytes(self) -> int:
        return self.memory.total

    @property
    def fits(self) -> bool:
        """The most loaded device stays inside the profile's usable memory."""
        return self.memory.total <= self.hardware.usable_memory

    @property
    def tflops_per_device(self) -> float:
        """Hardware TFLOP/s per device: ``F / (t_step * N) / 1e12`` (Narayanan et al. 2021)."""
        return self.hardware_flops / (self.step_time_s * self.layout.world) / 1e12

    @property
    def percent_of_peak(self) -> float:
        """``tflops_per_device`` as a percentage of the profile's dense peak."""
        return 100.0 * self.tflops_per_device / self.hardware.peak_tflops

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization in percent (recomputation not counted)."""
        return (
            100.0
            * self.model_flops
            / (self.step_time_s * self.layout.world)
            / (self.hardware.peak_tflops * 1e12)
        )

    @property
    def samples_per_s(self) -> float:
        return self.layout.batch / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``slipstream plan --json`` prints."""
        return {
            "step_time_s": self.step_time_s,
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "fits": self.fits,
            "usable_memory_bytes": self.hardware.usable_memory,
            "tflops_per_device": self.tflops_per_device,
            "percent_of_peak": self.percent_of_peak,
            "mfu_percent": self.mfu,
            "samples_per_s": self.samples_per_s,
            "hardware": self.hardware.name,
            "num_params": self.model.num_params(),
            "layout": self.layout.to_dict(),
            "memory_breakdown": self.memory.to_dict(),
            "time_breakdown": self.time.to_dict(),
        }


def predict(model: ModelSpec, hardware: Hardware, layout: Layout) -> Prediction:
    """Predict per-rank memory and step time of training ``model`` on ``hardware`` with ``layout``.

    Raises:
        ValueError: the layout cannot run the model (a TP size that does not divide the heads,
            stages that do not divide the layers, an inconsistent batch, ...).
    """
    check_layout(model, layout)
    return Prediction(
        model=model,
        hardware=hardware,
        layout=layout,
        memory=predict_memory(model, layout, hardware.reduce_scatter_scratch),
        time=predict_step_time(model, hardware, layout),
        hardware_flops=step_flops(model, layout.batch, layout.recompute),
        model_flops=model_flops(model, layout.batch),
    )
