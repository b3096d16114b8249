"""GPTConfig.activation_checkpointing: same loss and gradients, lower activation memory."""

from __future__ import annotations

import torch

from slipstream.models import GPT, GPTConfig
from slipstream.science._memory import TensorMemoryTracker


def _loss_and_grads(checkpointing: bool, dropout: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", dropout=dropout, activation_checkpointing=checkpointing)
    model = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # dropout masks: recomputation must replay the same ones
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]  # type: ignore[misc]


def test_gradients_identical_with_and_without_checkpointing() -> None:
    """Checkpointed blocks give bit-identical loss and gradients, dropout included."""
    for dropout in (0.0, 0.1):
        loss_ref, grads_ref = _loss_and_grads(False, dropout)
        loss_ckpt, grads_ckpt = _loss_and_grads(True, dropout)
        assert torch.equal(loss_ref, loss_ckpt)
        assert all(torch.equal(a, b) for a, b in zip(grads_ref, grads_ckpt))


def test_checkpointing_lowers_peak_training_memory() -> None:
    """At T=256 the forward + backward peak of tensor memory drops with checkpointing."""
    peaks = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = GPTConfig.preset(
            "tiny", max_seq_len=256, num_layers=4, activation_checkpointing=checkpointing
        )
        model = GPT(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 256))
        with TensorMemoryTracker() as mem:
            model(ids, ids).backward()
        peaks[checkpointing] = mem.peak_bytes
    assert peaks[True] < 0.75 * peaks[False], peaks


def test_no_checkpointing_without_grad() -> None:
    """Under no_grad the flag changes nothing (inference path is the plain one)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", activation_checkpointing=True)).eval()
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, 16, 256)
