"""Strategy planning: predict the memory and step time of a 3D-parallel + ZeRO layout, and
search the layouts that fit for the fastest (docs/planner.md).

Follows the performance reasoning of Dash et al. 2023 ("Optimizing Distributed Training on
Frontier for Large Language Models") with the formulas of Narayanan et al. 2021 (FLOPs,
pipeline bubble), Korthikanti et al. 2022 (activation memory) and Rajbhandari et al. 2020
(ZeRO states)::

    from slipstream.planner import Layout, load_hardware, model_preset, predict
    p = predict(model_preset("gpt3-175b"), load_hardware("dgx-a100-80gb"),
                Layout(tp=8, pp=8, micro_batch=1, global_batch=64, recompute="full"))
    p.step_time_s, p.memory_per_rank_bytes, p.percent_of_peak
"""

from slipstream.planner.flops import megatron_flops, model_flops, step_flops
from slipstream.planner.hardware import BUILTIN_PROFILES, Hardware, load_hardware
from slipstream.planner.layout import Layout, check_layout
from slipstream.planner.memory import PredictedMemory, predict_memory
from slipstream.planner.model import (
    PRESETS,
    ModelSpec,
    from_gpt_config,
    from_hf_config,
    megatron_gpt,
    model_preset,
)
from slipstream.planner.predict import Prediction, predict
from slipstream.planner.timing import StepTime, predict_step_time

__all__ = [
    "BUILTIN_PROFILES",
    "PRESETS",
    "Hardware",
    "Layout",
    "ModelSpec",
    "PredictedMemory",
    "Prediction",
    "StepTime",
    "check_layout",
    "from_gpt_config",
    "from_hf_config",
    "load_hardware",
    "megatron_flops",
    "megatron_gpt",
    "model_flops",
    "model_preset",
    "predict",
    "predict_memory",
    "predict_step_time",
    "step_flops",
]
