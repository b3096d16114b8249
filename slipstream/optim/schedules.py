"""DeepSpeed's learning-rate schedules, stepped once per optimizer step (per batch).

Same names, parameters, defaults and formulas as ``deepspeed.runtime.lr_schedules`` so a
DeepSpeed JSON ``scheduler`` block gives the same lr at every step. Contract shared by all five:

- ``last_batch_iteration`` is the index of the last batch; ``-1`` starts the schedule and
  writes its first value into every param group at construction, as DeepSpeed does. Any other
  value (resuming) leaves the optimizer's lr alone: it comes back with the optimizer state.
- ``step()`` advances the index by one (or sets it) and writes ``get_lr()`` into each group's
  ``lr`` (in place when ``lr`` is a tensor). ``get_last_lr()`` returns the values last written.
- ``state_dict()`` holds ``last_batch_iteration`` (DeepSpeed's checkpoint format) plus any
  extra this schedule needs; ``load_state_dict`` accepts DeepSpeed's dicts.

Deviations from DeepSpeed, each rejecting or keeping what DeepSpeed silently changes:
an unknown ``warmup_type`` is an error (DeepSpeed logs and falls back to ``log``), and
``OneCycle`` keeps each group's own ``beta2`` (DeepSpeed overwrites it with 0.99).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from slipstream._logging import logger
from slipstream.config._errors import ConfigError, did_you_mean

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

_WARMUP_TYPES = ("log", "linear")


class SupportsParamGroups(Protocol):
    """Anything with torch-style ``param_groups`` (a torch optimizer or a ZeRO wrapper)."""

    param_groups: list[dict[str, Any]]


def _per_group(value: float | Sequence[float], n_groups: int, key: str) -> list[float]:
    """One value per param group: a scalar is broadcast, a list must match the group count."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n_groups:
            raise ConfigError(
                f"scheduler.params.{key} has {len(value)} values but the optimizer has "
                f"{n_groups} param groups; give one value or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    is_int = isinstance(warmup_num_steps, int) and not isinstance(warmup_num_steps, bool)
    if not is_int or warmup_num_steps <= 0:
        raise ConfigError(
            f"scheduler.params.warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
        )
    if warmup_type not in _WARMUP_TYPES:
        hint = did_you_mean(str(warmup_type), _WARMUP_TYPES)
        tip = f"; did you mean '{hint}'?" if hint else ""
        raise ConfigError(
            f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}{tip}"
        )


def _warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of warmup done at ``iteration`` (0 at iteration 0, reaching 1 at num_steps)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def _write_lrs(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[float]:
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # keep the tensor (compiled / capturable optimizers hold it)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


class _BatchScheduler:
    """Stepping and checkpoint bookkeeping shared by the schedules; subclasses give get_lr()."""

    def __init__(self, optimizer: SupportsParamGroups, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def _start(self) -> None:
        """Apply the first value (fresh start) or record the optimizer's current lr (resume)."""
        if self.last_batch_iteration == -1:
            self._apply()
        else:
            self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def _apply(self) -> None:
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration`` (does not write it)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lr of each param group as last written by this scheduler."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next batch (or to ``last_batch_iteration``) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """``{'last_batch_iteration': int}``, DeepSpeed's format."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; the optimizer's lr is restored by its own state dict."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._last_lr = self.get_lr()


class LRRangeTest(_BatchScheduler):
    """LR range test (Smith, 2018, arXiv:1803.09820 section 4.1): grow the lr to find its limit.

    ``lr = min_lr * (1 + step_rate * interval)``, ``interval = (iteration + 1) / step_size``
    (floored when ``lr_range_test_staircase``).
    """

    def __init__(
        self,
        optimizer: SupportsParamGroups,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if lr_range_test_step_size <= 0:
            raise ConfigError(
                "scheduler.params.lr_range_test_step_size must be > 0, "
                f"got {lr_range_test_step_size}"
            )
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(lr_range_test_min_lr, n, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]


class WarmupLR(_BatchScheduler):
    """Warm the lr from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``lr = min + (max - min) * gamma``, ``gamma = log(it + 1) / log(N)`` (``log``) or
    ``it / N`` (``linear``) while ``it < N``, else 1; ``N = max(2, warmup_num_steps)``.
    ``warmup_max_lr=None`` takes each param group's own lr (DeepSpeed 0.19.8).
    """

    def __init__(
        self,
        optimizer: SupportsParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:  # each group warms up to its own lr
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._start()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then linear decay to 0 at ``total_num_steps``.

    After warmup ``gamma = max(0, (T - it) / max(1, T - N))``.
    """

    def __init__(
        self,
        optimizer: SupportsParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchScheduler):
    """Warm a ratio of the optimizer's base lr up to 1, then cosine-decay it to ``cos_min_ratio``.

    ``lr = base_lr * ratio``. Warmup (``it < N``): ``ratio = wmin + (1 - wmin) * frac`` with
    ``frac`` as in ``WarmupLR``. Then with ``p = min(1, (it - N + 1) / max(1, T - N))``:
    ``ratio = cmin + (1 - cmin) * (1 + cos(pi * p)) / 2``. Before the first step the lr is 0.
    ``base_lr`` is each group's lr at construction (its ``initial_lr`` when resuming); it is
    saved in the state dict and as ``initial_lr`` in the param groups, as torch schedulers do.
    """

    def __init__(
        self,
        optimizer: SupportsParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                self.warmup_num_steps,
            )
        # A fresh start takes the current lr as base (DeepSpeed); a resume prefers the
        # ``initial_lr`` saved with the optimizer's param groups, since ``lr`` is mid-schedule.
        for group in optimizer.param_groups:
            if last_batch_iteration == -1 or "initial_lr" not in group:
                group["initial_lr"] = float(group["lr"])
        self.base_lrs = [float(g["initial_lr"]) for g in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The multiplier of the base lr at ``last_batch_iteration``."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's ``last_batch_iteration`` plus ``base_lrs``."""
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore position and, when present (not in DeepSpeed's dicts), the base lrs."""
        if "base_lrs" in state_dict:
            self.base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
        super().load_state_dict(state_dict)


class OneCycle(_BatchScheduler):
    """1Cycle policy (Smith, 2018, arXiv:1803.09820 section 4): one lr cycle, then decay.

    Cycle (``it < S1 + S2``): with ``pos = (it + 1) mod (S1 + S2)``, ``scale = pos / S1`` on the
    way up, ``(S1 + S2 - pos) / S2`` on the way down; a stair count ``k > 0`` floors ``scale`` to
    multiples of ``1 / k``. ``lr = min_lr + (max_lr - min_lr) * scale`` and, when cycling
    momentum, ``beta1 = max_mom - (max_mom - min_mom) * scale``. After the cycle, with
    ``d = (it - S1 - S2 + 1) / decay_step_size``: ``lr = min_lr / (1 + decay_lr_rate * d)`` and
    ``beta1 = max_mom * (1 + decay_mom_rate * d)`` (no decay when the rate or
    ``decay_step_size`` is 0). Momentum is cycled only for optimizers with ``betas``; the group's
    ``beta2`` is kept. At construction ``lr = cycle_min_lr`` and ``beta1 = cycle_min_mom``, as
    in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: SupportsParamGroups,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        if cycle_first_step_size <= 0:
            raise ConfigError(
                f"scheduler.params.cycle_first_step_size must be > 0, got {cycle_first_step_size}"
            )
        if cycle_second_step_size is not None and cycle_second_step_size < 0:
            raise ConfigError(
                "scheduler.params.cycle_second_step_size must be >= 0, got "
                f"{cycle_second_step_size}"
            )
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        self.first_step_size = float(cycle_first_step_size)
        second = cycle_second_step_size
        self.second_step_size = self.first_step_size if second is None else float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        """Share of the cycle spent climbing (DeepSpeed's attribute)."""
        self.first_stair_count = cycle_first_stair_count
        stairs2 = cycle_second_stair_count
        self.second_stair_count = cycle_first_stair_count if stairs2 is None else stairs2
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.min_moms = _per_group(cycle_min_mom, n, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, n, "cycle_max_mom")
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and self._groups_have_betas()
        self._start()
        if self.cycle_momentum and last_batch_iteration == -1:
            self._write_beta1(self.min_moms)

    def _groups_have_betas(self) -> bool:
        if all("betas" in g for g in self.optimizer.param_groups):
            return True
        logger.warning(
            "OneCycle: cycle_momentum is disabled because the optimizer has no 'betas' "
            "(set scheduler.params.cycle_momentum to false to silence this)"
        )
        return False

    def _write_beta1(self, beta1: Sequence[float]) -> None:
        for group, b1 in zip(self.optimizer.param_groups, beta1, strict=True):
            group["betas"] = (b1, group["betas"][1])

    def _decay_intervals(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _scale(self) -> float:
        pos = (self.last_batch_iteration + 1) % self.total_size
        size, stairs, climbed = self.first_step_size, self.first_stair_count, pos
        if pos > self.first_step_size:  # on the way down
            size, stairs = self.second_step_size, self.second_stair_count
            climbed = self.total_size - pos
        if stairs > 0:
            # Floor on the integer position, not on the float ratio, so a stair edge that the
            # ratio misses by 1 ulp is not dropped a whole stair.
            return math.floor(climbed * stairs / size) / stairs
        return climbed / size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_intervals()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """Each group's ``beta1`` at ``last_batch_iteration``, or None when momentum is not
        cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_intervals()
        return [hi * factor for hi in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch: write the lr and, when cycling momentum, each group's beta1."""
        super().step(last_batch_iteration)
        momentum = self.get_mom()
        if momentum is not None:
            self._write_beta1(momentum)
