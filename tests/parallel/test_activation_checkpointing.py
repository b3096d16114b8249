"""``slipstream.checkpointing``: every mode recomputes to the same gradients (dropout
included) while keeping fewer activations; the config block and DeepSpeed's ``configure``
signature set it; misuse is named. TP partitioned activations: tests/parallel/
test_tensor_parallel.py. Pipeline recompute: test_pipeline_parity.py (``ckpt_1f1b_m4``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from slipstream import checkpointing
from slipstream.config import ConfigError
from slipstream.parallel import recompute


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    checkpointing.reset()
    yield
    checkpointing.reset()


class _Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _run(mode: str | None) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Loss, gradients and bytes saved for backward of 3 blocks, checkpointed or not."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3)).train()
    x = torch.randn(4, 32, 64, requires_grad=True)
    saved = [0]
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)  # dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in blocks:
            h = block(h) if mode is None else checkpointing.checkpoint(block, h)
    loss = h.square().mean()
    loss.backward()
    assert x.grad is not None
    grads = [x.grad] + [p.grad for p in blocks.parameters()]  # type: ignore[misc]
    return loss.detach(), grads, saved[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cpu_checkpointing": True},
        {"selective": True},
        {"synchronize_checkpoint_boundary": True, "profile": True},
    ],
    ids=["full", "cpu", "selective", "sync-profile"],
)
def test_same_gradients_fewer_saved_activations(options: dict[str, Any]) -> None:
    """Each mode: bit-identical loss and gradients (dropout masks replayed) and fewer bytes
    saved than plain autograd; full recompute keeps only the block inputs."""
    loss_ref, grads_ref, saved_ref = _run(None)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": options})
    loss, grads, saved = _run("ckpt")
    assert torch.equal(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Only the block inputs go through autograd's saved tensors (selective checkpointing
    # keeps its matmul outputs in its own cache: see the next test).
    assert saved == 3 * 4 * 32 * 64 * 4 < saved_ref


def _count_matmuls(mode: str | None) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        _run(mode)
    return Count.n


def test_selective_recomputes_no_matmul() -> None:
    """Full recompute runs every block's two matmuls again in backward; selective
    recompute reuses their outputs, so it runs exactly as many as no checkpointing."""
    plain = _count_matmuls(None)
    checkpointing.configure(None, selective=False)
    full = _count_matmuls("ckpt")
    checkpointing.configure(None, selective=True)
    selective = _count_matmuls("ckpt")
    assert full == plain + 6 and selective == plain


def test_cpu_checkpointing_keeps_inputs_in_host_memory() -> None:
    """cpu_checkpointing stashes the kept inputs on the CPU (a no-op move on a CPU run, but
    the stashed copy is a different tensor than the input)."""
    checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 8, 64, requires_grad=True)
    out = checkpointing.checkpoint(block, x)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_CheckpointFunctionBackward"
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_no_recompute_without_grad() -> None:
    """Under no_grad the function just runs (no autograd node)."""
    block = _Block().eval()
    with torch.no_grad():
        out = checkpointing.checkpoint(block, torch.randn(2, 4, 64))
    assert out.grad_fn is None


def test_configure_surface_and_errors() -> None:
    """DeepSpeed's configure(): a block, a whole config or keyword overrides; misuse named."""
    checkpointing.configure(None, deepspeed_config={"cpu_checkpointing": True})
    assert checkpointing.is_configured()
    checkpointing.configure(None, partition_activations=False, profile=True)
    with pytest.raises(ConfigError, match="selective keeps matmul outputs"):
        checkpointing.configure(None, selective=True, checkpoint_in_cpu=True)
    with pytest.raises(TypeError, match="get_tensor_model_parallel_group"):
        checkpointing.configure(object())
    with pytest.raises(Exception, match="contiguous_memory_optimization"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    checkpointing.reset()
    assert not checkpointing.is_configured()


def test_selective_recomputes_attention_with_dropout() -> None:
    """Attention kernels are kept unless they apply dropout: skipping a random op in the
    recompute would shift later dropout masks (seen on CUDA: gradients 3e-2 off)."""
    from torch.utils.checkpoint import CheckpointPolicy

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 4, 8)
    policy = recompute._save_matmuls
    assert policy(None, op, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
    assert policy(None, op, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, op, q, q, q, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, op, q, q, q) == CheckpointPolicy.MUST_SAVE  # schema default 0.0
    assert policy(None, torch.ops.aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE


def test_engine_contexts_do_not_share_state() -> None:
    """A RecomputeContext holds its own options and tracker: configuring one leaves the
    process default (DeepSpeed's module API) and other contexts as they were, and a model
    runs its blocks through the context it was given."""
    from slipstream.models import GPT, GPTConfig
    from slipstream.parallel.random import RNGStatesTracker, get_rng_tracker

    class Counting(recompute.RecomputeContext):
        calls = 0

        def run(self, function: Any, *args: Any) -> Any:
            Counting.calls += 1
            return super().run(function, *args)

    tracker = RNGStatesTracker()
    mine = Counting(tracker)
    mine.configure(None, selective=True)
    assert mine.options.selective and mine.rng_tracker is tracker
    assert not checkpointing.is_configured() and not recompute.DEFAULT_CONTEXT.options.selective
    assert recompute.DEFAULT_CONTEXT.rng_tracker is get_rng_tracker()

    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", activation_checkpointing=True)
    bound, other = GPT(config), GPT(config)
    assert recompute.use_recompute_context_(bound, mine) == 1
    assert bound.recompute_context is mine
    assert other.recompute_context is recompute.DEFAULT_CONTEXT
    ids = torch.randint(0, config.vocab_size, (2, 16))
    other(ids, ids).backward()
    assert Counting.calls == 0
    bound(ids, ids).backward()
    assert Counting.calls == config.num_layers
