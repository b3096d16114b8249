"""DeepSpeed's ZeRO optimizer class names, for ``isinstance`` checks in code written for
DeepSpeed (Accelerate, Lightning, DeepSpeed's own test helpers).

``isinstance(opt, DeepSpeedZeroOptimizer)`` is true for slipstream's ``ZeroOptimizer`` at
stages 1 and 2, ``isinstance(opt, DeepSpeedZeroOptimizer_Stage3)`` at stage 3, as they are for
DeepSpeed's engine optimizers at those stages. Building one directly is refused: slipstream
builds its ZeRO optimizer in ``initialize`` from the ``zero_optimization`` block.
"""

from __future__ import annotations

from typing import Any

from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.sharded_store import ShardedStore

__all__ = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


def _stage(obj: Any) -> int | None:
    if not isinstance(obj, ZeroOptimizer):
        return None
    if isinstance(obj.store, ShardedStore):
        return 3
    return 1 if obj.partition else 0  # stages 1 and 2 share the flat partitioned store


class _StageCheck(type):
    stages: tuple[int, ...] = ()

    def __instancecheck__(cls, obj: Any) -> bool:
        return _stage(obj) in cls.stages


class _Refused:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is not built directly in slipstream: deepspeed.initialize "
            "builds the ZeRO optimizer from the config's zero_optimization block"
        )


class DeepSpeedZeroOptimizer(_Refused, metaclass=_StageCheck):
    """Stages 1 and 2 (see the module docstring)."""

    stages = (1, 2)


class DeepSpeedZeroOptimizer_Stage3(_Refused, metaclass=_StageCheck):
    """Stage 3 (see the module docstring)."""

    stages = (3,)
