"""``autotuning``: DeepSpeed's autotuner block, read by ``slipstream tune`` (docs/planner.md).

As in DeepSpeed, the block changes nothing when a script trains with the config: it takes
effect only when the tuner runs (``slipstream tune``, DeepSpeed's ``deepspeed --autotuning``).
Keys slipstream's tuner does not implement are refused with the reason.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError

__all__ = ["AutotuningConfig", "ModelInfoConfig"]

# DeepSpeed keys the tuner does not implement, and why.
_REFUSED: dict[str, str] = {
    "metric_path": "slipstream tune reads each run's metric from its step log "
    "(steps_per_print = 1); the engine writes no metric file",
    "tuner_early_stopping": "the planner ranks every candidate first and only its best "
    "--top/tuner_num_trials are measured; there is no long search to stop early",
}


class ModelInfoConfig(StrictModel):
    """``autotuning.model_info``: the model's shape, which the planner needs to predict memory
    and step time. DeepSpeed's keys (``num_params``, ``hidden_size``, ``num_layers``) and the
    ones the planner also needs, named as in Hugging Face configs."""

    e_notation = frozenset({"num_params"})

    profile: Literal[False] = False
    """DeepSpeed profiles the model in a first run when true; slipstream's tuner needs the
    shape given here instead (a profiling run is not implemented)."""
    num_params: int | None = Field(None, ge=1)
    """Parameter count, checked against the shape (within 10%) when given."""
    hidden_size: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    """Grouped-query attention; omitted means ``num_attention_heads``."""
    intermediate_size: int | None = Field(None, ge=1)
    """The gated (SwiGLU) MLP's width of a LLaMA-style model such as slipstream's reference
    GPT; omitted means a Megatron GPT (4h GELU MLP, biases, learned positions)."""
    vocab_size: int | None = Field(None, ge=1)
    seq_length: int | None = Field(None, ge=1)
    """Training sequence length."""
    tie_word_embeddings: bool | None = None
    """Output layer shares the embedding (default: false LLaMA-style, true Megatron)."""


class AutotuningConfig(StrictModel):
    """``autotuning``: what ``slipstream tune`` searches, how it measures, where it writes.

    The tuner enumerates layouts (tensor-parallel size, ZeRO stage, micro-batch) with the
    planner, drops those predicted not to fit, ranks the rest by the predicted metric, runs
    the best few for a few steps through ``slipstream run`` and keeps the measured best.
    """

    enabled: bool = False
    """Accepted as DeepSpeed has it; the tuner runs only through ``slipstream tune``."""
    fast: bool = True
    """true: measure the planner's best 3 candidates; false: up to ``tuner_num_trials``."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What "best" means: samples/s, the shortest step, or model FLOP/s."""
    start_profile_step: int = Field(3, ge=1)
    """Steps up to this one are warm-up; the metric covers the steps after it..."""
    end_profile_step: int = Field(5, ge=2)
    """... up to this one, after which the run is stopped."""
    results_dir: str = "autotuning_results"
    """Where ``summary.json`` and ``ds_config_optimal.json`` (the best config) are written."""
    exps_dir: str = "autotuning_exps"
    """Where each candidate's config and log are written."""
    overwrite: bool = True
    """false: a candidate whose result is already in ``exps_dir`` is not run again."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "model_based"
    """Order in which candidates are measured: "model_based" and "gridsearch" the planner's
    ranking (the planner is the cost model), "random" a seeded shuffle of those that fit."""
    tuner_num_trials: int = Field(50, ge=1)
    """At most this many candidates are measured (with ``fast`` false)."""
    arg_mappings: dict[str, str] | None = None
    """Config key -> script argument (e.g. ``{"train_micro_batch_size_per_gpu":
    "--per_device_train_batch_size"}``): each run also gets ``ARG VALUE`` for these keys."""
    mp_size: int = Field(1, ge=1)
    """Model (tensor) parallel size the script uses; > 1 holds TP at this size."""
    max_train_batch_size: int | None = Field(None, ge=1)
    """Largest global batch tried when ``train_batch_size`` is not fixed."""
    min_train_batch_size: int = Field(1, ge=1)
    """Smallest global batch tried when ``train_batch_size`` is not fixed."""
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    """Micro-batch sizes tried (powers of two from the minimum)."""
    model_info: ModelInfoConfig | None = None
    """The model's shape (or ``model_info_path``)."""
    model_info_path: str | None = None
    """A JSON file holding ``model_info``."""

    metric_path: str | None = None
    """Refused (DeepSpeed's engine writes the metric there): see ``_REFUSED``."""
    tuner_early_stopping: int | None = None
    """Refused: see ``_REFUSED``."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, reason in _REFUSED.items():
                if data.get(key) is not None:
                    raise ConfigError(f"autotuning.{key} is not supported: {reason}; remove it")
            info = data.get("model_info")
            if isinstance(info, dict) and info.get("profile") is True:
                raise ConfigError(
                    "autotuning.model_info.profile = true is not supported: slipstream's tuner "
                    "does not profile the model in a separate run; give its shape in "
                    "model_info (hidden_size, num_layers, num_attention_heads, vocab_size, "
                    "seq_length) and set profile to false"
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> AutotuningConfig:
        if self.end_profile_step <= self.start_profile_step:
            raise ConfigError(
                f"autotuning.end_profile_step = {self.end_profile_step} must be greater than "
                f"start_profile_step = {self.start_profile_step}: the steps in between are "
                "measured"
            )
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ConfigError(
                "autotuning.max_train_micro_batch_size_per_gpu = "
                f"{self.max_train_micro_batch_size_per_gpu} is below "
                f"min_train_micro_batch_size_per_gpu = {self.min_train_micro_batch_size_per_gpu}"
            )
        if self.model_info is not None and self.model_info_path is not None:
            raise ConfigError("autotuning: give model_info or model_info_path, not both")
        return self
