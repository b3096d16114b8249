"""Rank-side training runs for the monitor tests (importable by spawned workers)."""

from __future__ import annotations

import time
from typing import Any

import torch

import slipstream
from slipstream.models import GPT, GPTConfig


class SlowBackend:
    """Holds the writer thread 50 ms per batch, so events are still queued when training
    ends and only a flush (destroy or exit) gets them to disk."""

    def write(self, events: Any) -> None:
        time.sleep(0.05)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def train(out_dir: str, steps: int, *, fp16: bool = False, gas: int = 2) -> dict[str, Any]:
    """Train a tiny GPT with TensorBoard and CSV monitors under ``out_dir``; return what the
    monitors should hold, computed independently on the host."""
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # lr changes every step, so a stale or misplaced lr event is visible.
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        },
        "tensorboard": {"enabled": True, "output_path": f"{out_dir}/tb", "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": f"{out_dir}/csv", "job_name": "run"},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, opt, _, _ = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    rank = engine.global_rank
    if engine.monitor.active:
        engine.monitor.backends.insert(0, SlowBackend())
    g = torch.Generator().manual_seed(100 + rank)
    expected: dict[str, list[tuple[int, float]]] = {}
    window: list[float] = []
    walls: list[tuple[int, float]] = [(0, time.time())]  # (step, wall time right after it)
    for _ in range(steps * gas):
        t = torch.randint(0, 256, (2, 17), generator=g)
        loss = engine(t[:, :-1], t[:, 1:])
        window.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
        # An in-place change after the step (an all-reduce for logging) must not reach the
        # monitor, which reads the loss up to a second later.
        loss.detach().add_(1000.0)
        if len(window) == gas:
            step = engine.global_samples
            walls.append((step, time.time()))
            expected.setdefault("Train/Samples/train_loss", []).append((step, sum(window) / gas))
            expected.setdefault("Train/Samples/lr", []).append((step, engine.get_lr()[0]))
            if fp16:
                expected.setdefault("Train/Samples/loss_scale", []).append((step, opt.loss_scale))
            window = []
    engine.monitor.write_events([("User/tokens", torch.tensor(123.0), 5), ("User/n", 2, 6)])
    return {
        "rank": rank,
        "expected": expected,
        "walls": walls,
        "enabled": engine.monitor.enabled,
        "active": engine.monitor.active,
        "engine": engine,
    }


def pipeline_train(out_dir: str, steps: int) -> list[float]:
    """Two pipeline stages with a CSV monitor: ``train_batch``'s losses (every rank)."""
    from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers
    from slipstream.pipe import PipelineModule
    from tests.parallel._pipe_workloads import MICRO, gpt_config, micro_iter

    torch.manual_seed(0)
    module = PipelineModule(gpt_pipeline_layers(gpt_config()), num_stages=2, loss_fn=gpt_loss)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "pipe"},
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    it = micro_iter(2, 1, 0)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    engine.destroy()
    return losses


def train_and_exit(out_dir: str, steps: int) -> dict[str, Any]:
    """A rank of the 2-rank run: a pipeline run, then a data-parallel run that returns
    without ``engine.destroy()`` (its monitors must still be flushed when the process exits)."""
    pipe_losses = pipeline_train(out_dir, steps)
    result = train(out_dir, steps)
    del result["engine"]
    result["pipe_losses"] = pipe_losses
    return result
