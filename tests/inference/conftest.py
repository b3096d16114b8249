"""Fixtures of the inference tests; the tiny models live in tests/_tiny_models.py."""

from __future__ import annotations

import pytest
import torch

from tests._tiny_models import tiny_gpt2, tiny_llama

pytest.importorskip("transformers")

MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


@pytest.fixture(params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return MODELS[request.param]()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread (on a loaded machine two threads spend their time
    waiting for each other at every op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
