"""Rank-side checks of NVMe optimizer-state offload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.models import GPT, GPTConfig


def _run(config: dict[str, Any], preset: str, steps: int, seq: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine, opt, _, _ = slipstream.initialize(model=GPT(GPTConfig.preset(preset)), config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, 256, (2, seq + 1), generator=g)
    losses = []
    for _ in range(steps):
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    out = {"losses": losses, "params": params, "state_bytes": opt.state_bytes(), "engine": engine}
    return out


def parity_and_corruption(swap_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for bf16 in (False, True):
            base = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {
                    "stage": stage,
                    "reduce_bucket_size": 20000,
                    "stage3_param_persistence_threshold": 0,
                },
                "bf16": {"enabled": bf16},
            }
            plain = _run(base, "tiny", 3, 16)
            plain["engine"].destroy()
            zero = dict(
                base["zero_optimization"],
                offload_optimizer={"device": "nvme", "nvme_path": f"{swap_dir}/{stage}{bf16}"},
            )
            swapped = _run(dict(base, zero_optimization=zero), "tiny", 3, 16)
            swapped["engine"].destroy()
            out[(stage, bf16)] = {
                "same_losses": plain["losses"] == swapped["losses"],
                "same_params": all(
                    torch.equal(a, b) for a, b in zip(plain["params"], swapped["params"])
                ),
                "state_in_memory": swapped["state_bytes"],
            }
    # Corrupt one swap file between steps: the next step names it.
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": f"{swap_dir}/corrupt"}}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {}},
        "zero_optimization": zero,
    }
    run = _run(config, "tiny", 1, 16)
    engine = run["engine"]
    victim = sorted(Path(f"{swap_dir}/corrupt/rank{dist.get_rank()}").glob("s*.swap"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    x = torch.randint(0, 256, (2, 16))
    try:
        engine.backward(engine(x, x))
        engine.step()
        out["corrupt"] = None
    except RuntimeError as e:
        out["corrupt"] = (str(e), str(victim))
    engine.destroy()
    return out


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss(swap_dir: str | None) -> int:
    """Peak resident bytes above the pre-initialize level for 2 steps of GPT-25m (stage 2)."""
    zero: dict[str, Any] = {"stage": 2, "reduce_bucket_size": 2_000_000}
    if swap_dir:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {}},
        "zero_optimization": zero,
    }
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("25m"))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _vm("VmRSS")
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    x = torch.randint(0, 256, (2, 8))
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    return _vm("VmHWM") - before


def cpu_offload_path() -> dict[str, Any]:
    """offload_optimizer.device = "cpu" with SLIPSTREAM_FORCE_CPU_OFFLOAD=1: the GPU code path
    (separate host masters, gradients copied over, weights copied back) run on CPU."""
    import os

    out: dict[str, Any] = {}
    for stage in (2, 3):
        base = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        plain = _run(base, "tiny", 3, 16)
        plain["engine"].destroy()
        os.environ["SLIPSTREAM_FORCE_CPU_OFFLOAD"] = "1"
        zero = dict(base["zero_optimization"], offload_optimizer={"device": "cpu"})
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}  # shards in host memory
        off = _run(dict(base, zero_optimization=zero), "tiny", 3, 16)
        del os.environ["SLIPSTREAM_FORCE_CPU_OFFLOAD"]
        opt = off["engine"].optimizer
        out[stage] = {
            "same_losses": plain["losses"] == off["losses"],
            "same_params": all(torch.equal(a, b) for a, b in zip(plain["params"], off["params"])),
            "separate_masters": opt.master_bytes() > 0,
            "master_bytes": opt.master_bytes(),
            "estimate": slipstream.zero.estimate_memory(
                GPT(GPTConfig.preset("tiny")),
                dist.get_world_size(),
                stage,
                offload_optimizer="cpu",
                offload_param="cpu" if stage == 3 else None,
            ),
        }
        off["engine"].destroy()
    return out
