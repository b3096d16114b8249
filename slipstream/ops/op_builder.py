"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answering that nothing needs building.

DeepSpeed compiles C++/CUDA extensions (fused Adam, CPU Adam, async I/O, quantizers, ...)
through one ``OpBuilder`` class per op, and code asks them ``is_compatible()`` before using an
op or skips what cannot be built. slipstream compiles nothing: the ops it offers run on
torch's own kernels. Each builder here keeps DeepSpeed's ``NAME`` and method names:

- ``is_compatible()`` is true for the ops slipstream runs without a build (fused Adam and CPU
  Adam: ``deepspeed.ops.adam``, torch's kernels) and false, with the reason when
  ``verbose``, for the ops slipstream does not provide;
- ``load()`` never builds: it raises an error naming what to use instead (a provided op's
  Python class needs no loaded extension; a missing op has none).

``ALL_OPS`` maps each name to its builder, and ``deepspeed.ops.__compatible_ops__`` holds the
``is_compatible()`` answers, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any, ClassVar

from slipstream._logging import logger

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CCLCommBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "GDSBuilder",
    "InferenceBuilder",
    "NotImplementedBuilder",
    "OpBuilder",
    "PinMemoryBuilder",
    "QuantizerBuilder",
    "RandomLTDBuilder",
    "ShareMemCommBuilder",
    "SparseAttnBuilder",
    "SpatialInferenceBuilder",
    "StochasticTransformerBuilder",
    "TransformerBuilder",
    "get_default_compute_capabilities",
]

NOT_NEEDED = "not needed: slipstream compiles nothing"


class OpBuilder:
    """One DeepSpeed op. ``PROVIDED`` names the slipstream class that does its work, if any."""

    NAME: ClassVar[str] = "deepspeed_not_implemented"
    PROVIDED: ClassVar[str] = ""
    """The slipstream (``deepspeed.*``) name that runs this op without a build, or empty."""
    _loaded_ops: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        self.error_log: str | None = None

    def absolute_name(self) -> str:
        """DeepSpeed's extension module path (``deepspeed.ops.<kind>.<name>_op``)."""
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self) -> list[str]:
        """No sources: nothing is compiled."""
        return []

    def include_paths(self) -> list[str]:
        return []

    def cxx_args(self) -> list[str]:
        return []

    def nvcc_args(self) -> list[str]:
        return []

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether slipstream runs this op (without building anything)."""
        if not self.PROVIDED:
            self.error_log = (
                f"{self.NAME}: slipstream does not provide this DeepSpeed op ({NOT_NEEDED})"
            )
            if verbose:
                logger.warning(self.error_log)
            return False
        return True

    def builder(self) -> Any:
        """DeepSpeed returns a torch ``CppExtension``; there is nothing to build."""
        raise RuntimeError(self._load_message())

    def load(self, verbose: bool = True) -> Any:
        """Never builds: the error names what to use instead."""
        raise RuntimeError(self._load_message())

    def jit_load(self, verbose: bool = True) -> Any:
        raise RuntimeError(self._load_message())

    def _load_message(self) -> str:
        if self.PROVIDED:
            return (
                f"{type(self).__name__}().load(): {NOT_NEEDED}; {self.NAME} runs on torch's "
                f"kernels as {self.PROVIDED}, which needs no loaded extension"
            )
        return (
            f"{type(self).__name__}().load(): slipstream does not provide the DeepSpeed op "
            f"{self.NAME!r} and compiles nothing (is_compatible() is False)"
        )


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    PROVIDED = "deepspeed.ops.adam.FusedAdam"


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    PROVIDED = "deepspeed.ops.adam.DeepSpeedCPUAdam"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"


class GDSBuilder(OpBuilder):
    NAME = "gds"


class PinMemoryBuilder(OpBuilder):
    NAME = "pin_memory"


class QuantizerBuilder(OpBuilder):
    NAME = "quantizer"


class FPQuantizerBuilder(OpBuilder):
    NAME = "fp_quantizer"


class TransformerBuilder(OpBuilder):
    NAME = "transformer"


class StochasticTransformerBuilder(OpBuilder):
    NAME = "stochastic_transformer"


class InferenceBuilder(OpBuilder):
    NAME = "transformer_inference"


class SpatialInferenceBuilder(OpBuilder):
    NAME = "spatial_inference"


class SparseAttnBuilder(OpBuilder):
    NAME = "sparse_attn"


class EvoformerAttnBuilder(OpBuilder):
    NAME = "evoformer_attn"


class RandomLTDBuilder(OpBuilder):
    NAME = "random_ltd"


class CCLCommBuilder(OpBuilder):
    NAME = "deepspeed_ccl_comm"


class ShareMemCommBuilder(OpBuilder):
    NAME = "deepspeed_shm_comm"


class NotImplementedBuilder(OpBuilder):
    NAME = "deepspeed_not_implemented"


ALL_OPS: dict[str, type[OpBuilder]] = {
    b.NAME: b
    for b in (
        FusedAdamBuilder,
        CPUAdamBuilder,
        CPUAdagradBuilder,
        CPULionBuilder,
        FusedLambBuilder,
        FusedLionBuilder,
        AsyncIOBuilder,
        GDSBuilder,
        PinMemoryBuilder,
        QuantizerBuilder,
        FPQuantizerBuilder,
        TransformerBuilder,
        StochasticTransformerBuilder,
        InferenceBuilder,
        SpatialInferenceBuilder,
        SparseAttnBuilder,
        EvoformerAttnBuilder,
        RandomLTDBuilder,
        CCLCommBuilder,
        ShareMemCommBuilder,
        NotImplementedBuilder,
    )
}


def get_default_compute_capabilities() -> str:
    """DeepSpeed's default CUDA arch list; nothing is compiled for it here."""
    return "6.0;6.1;7.0"
