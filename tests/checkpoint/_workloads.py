"""Rank-side checkpoint scenarios (run under tests.distributed.harness.run_world)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import slipstream
from slipstream.checkpoint import CheckpointError
from slipstream.models import GPT, GPTConfig

GLOBAL_BATCH = 8
SEQ = 16


def _config(
    stage: int, world: int, bf16: bool = False, offload: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zero["offload_optimizer"] = offload
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        **extra,
    }


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randint(0, 256, (6 * GLOBAL_BATCH, SEQ + 1), generator=g))


def _engine(
    stage: int,
    bf16: bool = False,
    dropout: float = 0.1,
    offload: dict[str, Any] | None = None,
    **extra: Any,
) -> Any:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", dropout=dropout))
    config = _config(stage, world, bf16, offload, **extra)
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=config, training_data=_dataset()
    )
    return engine, loader


def _train(engine: Any, loader: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps over the loader (new epochs as needed); mean loss per step."""
    losses = []
    while len(losses) < steps:
        for (batch,) in loader:
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            if len(losses) == steps:
                break
        else:
            loader.set_epoch(loader.sampler.epoch + 1)
    return losses


def exact_resume(
    root: str, stage: int, bf16: bool, nvme: bool = False, asynchronous: bool = False
) -> dict[str, Any]:
    """Uninterrupted 8 steps vs 4 steps + save + fresh engine + load + 4 steps (crosses an
    epoch boundary: 6 steps per epoch). ``nvme``: optimizer states swapped to files;
    ``asynchronous``: the save is written in the background while 2 more steps run."""

    def build(run: int) -> Any:
        extra: dict[str, Any] = {"checkpoint": {"async_save": asynchronous}}
        if nvme:
            swap = os.path.join(root, f"swap{run}")  # the swapper adds a per-rank subdirectory
            extra["offload"] = {"device": "nvme", "nvme_path": swap}
        return _engine(stage, bf16, **extra)

    engine, loader = build(0)
    straight = _train(engine, loader, 8)
    engine.destroy()

    d = os.path.join(root, f"s{stage}-{int(bf16)}")
    engine, loader = build(1)
    first = _train(engine, loader, 4)
    engine.save_checkpoint(d, client_state={"note": "hello", "step": 4})
    _train(engine, loader, 2)  # moves on: the load below must bring everything back
    engine.destroy()

    torch.manual_seed(123)  # a different RNG state: the checkpoint restores it
    engine, loader = build(2)
    path, client = engine.load_checkpoint(d)
    steps = engine.global_steps
    resumed = _train(engine, loader, 4)
    engine.destroy()
    return {
        "straight": straight,
        "resumed": first + resumed,
        "client": client,
        "path": path,
        "steps": steps,
    }


def save_at(root: str, stage: int, steps: int, tag: str) -> list[float]:
    engine, loader = _engine(stage, dropout=0.0)
    losses = _train(engine, loader, steps)
    engine.save_checkpoint(root, tag=tag)
    engine.destroy()
    return losses


def load_and_continue(root: str, stage: int, tag: str, resave: str, steps: int) -> list[float]:
    """Load (any world/stage), save again unchanged, then train ``steps`` more."""
    engine, loader = _engine(stage, dropout=0.0)
    engine.load_checkpoint(root, tag=tag)
    engine.save_checkpoint(resave, tag=tag)
    losses = _train(engine, loader, steps)
    engine.destroy()
    return losses


def missing_rank(root: str) -> str:
    engine, _ = _engine(1, dropout=0.0, checkpoint={"barrier_timeout": 3})
    if dist.get_rank() == 1:
        return "skipped"
    try:
        engine.save_checkpoint(root)
    except CheckpointError as e:
        return str(e)
    return "no error"


def failures(root: str) -> dict[str, Any]:
    """One process: crash mid-save keeps the previous checkpoint; corruption is named."""
    out: dict[str, Any] = {}
    engine, loader = _engine(3, dropout=0.0, checkpoint={"keep_last": 2})
    _train(engine, loader, 1)
    engine.save_checkpoint(root, tag="good")
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        good = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    opt_bytes = engine.optimizer.state_bytes()
    _train(engine, loader, 1)

    import slipstream.checkpoint.api as api

    real = api.write_object

    def crash(path: Path, obj: Any) -> Any:
        if path.name == "extra.pt":
            raise OSError("disk full (injected)")
        return real(path, obj)

    api.write_object = crash  # type: ignore[assignment]
    try:
        engine.save_checkpoint(root, tag="bad")
    except CheckpointError as e:
        out["crash"] = str(e)
    finally:
        api.write_object = real  # type: ignore[assignment]
    out["after_crash"] = sorted(os.listdir(root))
    out["latest"] = Path(root, "latest").read_text()

    engine2, _ = _engine(3, dropout=0.0)
    path, _ = engine2.load_checkpoint(root)
    out["loaded"] = path
    with slipstream.zero.GatheredParameters(list(engine2.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine2.module.state_dict().items()}
    out["equal_after_crash"] = all(torch.equal(good[n], got[n]) for n in good)
    out["opt_bytes"] = (opt_bytes, engine2.optimizer.state_bytes())

    # keep_last = 2: after three more saves only the two newest remain.
    for tag in ("t1", "t2", "t3"):
        engine.save_checkpoint(root, tag=tag)
    out["kept"] = sorted(d for d in os.listdir(root) if not d.startswith(".") and d != "latest")

    shard = Path(root, "t3", "rank-00000.safetensors")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    try:
        engine2.load_checkpoint(root, tag="t3")
        out["corrupt"] = "no error"
    except CheckpointError as e:
        out["corrupt"] = str(e)
    Path(root, "t2", "rank-00000.safetensors").write_bytes(data[:100])
    try:
        engine2.load_checkpoint(root, tag="t2")
        out["truncated"] = "no error"
    except CheckpointError as e:
        out["truncated"] = str(e)
    out["no_latest"] = engine2.load_checkpoint(os.path.join(root, "nowhere"))
    engine.destroy()
    engine2.destroy()
    return out


def hf_save(root: str) -> dict[str, torch.Tensor]:
    """Train a tiny HF Llama 4 steps at ZeRO-3 (bf16), save; return its gathered parameters
    (WarmupLR: the first two steps run at lr 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    world = dist.get_world_size()
    engine, *_ = slipstream.initialize(model=LlamaForCausalLM(cfg), config=_config(3, world, True))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x = torch.randint(0, 256, (GLOBAL_BATCH // world, SEQ), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(root)
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = engine.optimizer.masters
    engine.destroy()
    return {"params": params, "n_masters": len(masters)}  # type: ignore[dict-item]
