"""Tiled MLP, tiled logits+loss and cpu_checkpointing on Hugging Face causal LMs: fp64 equality
with the untouched model, no [S, vocab] / [S, intermediate] tensor, and SP=2 x ZeRO through
initialize equal to one process."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.config.parallel import ActivationCheckpointingConfig
from slipstream.parallel.recompute import RecomputeContext, bind_hf_checkpointing_
from slipstream.sequence.hf_tiling import tile_hf_loss_, tile_hf_mlp_
from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.sequence import _tiled_workloads as tw

VOCAB, HIDDEN, INTER, SEQ = 96, 16, 40, 24


def _model(family: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    cls, cfg = (
        (LlamaForCausalLM, LlamaConfig) if family == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    )
    return cls(cfg(**kw)).double().train()


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op produced while active, per last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.numel: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim():
                last = t.shape[-1]
                self.numel[last] = max(self.numel.get(last, 0), t.numel())
        return out


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Any:
    model.zero_grad()
    with _Largest() as largest:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads, largest.numel


@pytest.mark.parametrize("family, offload", [("llama", True), ("qwen2", False)])
def test_tiled_hf_model_equals_plain_fp64(family: str, offload: bool) -> None:
    """Tiled MLP (3 chunks) + tiled loss (5 chunks) + HF gradient checkpointing, through
    slipstream's cpu_checkpointing (LLaMA) or HF's own non-reentrant checkpoint (Qwen2):
    loss and every gradient equal the plain model's in fp64
    (rtol 1e-10); no tensor as large as the [B*S, vocab] logits or the [B*S, intermediate]
    MLP activations exists; eval mode keeps the model's own forward (with logits)."""
    plain = _model(family)
    tiled = copy.deepcopy(plain)
    tile_hf_mlp_(tiled, 3)
    tile_hf_loss_(tiled, 5)
    tiled.gradient_checkpointing_enable()
    context = RecomputeContext()
    context.configure(None, ActivationCheckpointingConfig(cpu_checkpointing=True))
    if offload:
        bind_hf_checkpointing_(tiled, context)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100
    ref, ref_grads, ref_largest = _loss_and_grads(plain, ids, labels)
    out, grads, largest = _loss_and_grads(tiled, ids, labels)
    assert out.logits is None and ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-10, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-13, msg=name)
    tokens = ids.numel()
    assert ref_largest[VOCAB] >= tokens * VOCAB and ref_largest[INTER] >= tokens * INTER
    assert largest[VOCAB] <= max(-(-tokens // 5), HIDDEN) * VOCAB, largest  # chunk or weight
    assert largest[INTER] <= max(-(-tokens // 3), HIDDEN) * INTER, largest  # chunk or weight
    bound = tiled.model.layers[0]._gradient_checkpointing_func == context.run
    assert bound == offload
    tiled.eval()
    with torch.no_grad():
        evaluated = tiled(input_ids=ids, labels=labels)
    assert evaluated.logits is not None
    torch.testing.assert_close(evaluated.loss, ref.loss, rtol=1e-10, atol=0)


def test_tiling_refusals_name_the_key() -> None:
    """A model with no gated MLP, and logit softcapping, are refused naming the config key."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"tiled_compute\.mlp: GPT2LMHeadModel has no gated MLP"):
        tile_hf_mlp_(gpt2)
    llama = _model("llama")
    llama.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        tile_hf_loss_(llama)


@pytest.fixture(scope="module")
def world2() -> list[Any]:
    return run_world(tw.world, 2, tw.RUNS)


def test_sp2_zero_tiled_cpu_checkpointing_matches_single_process(world2: list[Any]) -> None:
    """SP=2 through initialize with tiled_compute (mlp, logits_loss), cpu_checkpointing on HF
    gradient checkpointing, at ZeRO-3 (LLaMA, GQA): losses
    and parameters after 3 SGD steps equal one untiled process's (fp32: loss rtol 1e-5,
    params rtol 1e-5 / atol 2e-5); the tiled forward returns no logits."""
    for run in tw.RUNS:
        got = world2[0][run]
        assert got["logits_none"] == [True], run
        assert got["bound"] == "run", run
        assert_same_training(
            got, tw.reference(run[0]), f"tiled SP=2 {run}", param_rtol=1e-5, param_atol=2e-5
        )


_NAMES = """
import inspect, json, sys
sys.path.insert(0, {root!r})
if {ours}:
    from slipstream.runtime.sequence_parallel import ulysses_sp
else:
    from tests.compat._deepspeed import import_deepspeed
    import_deepspeed()
    from deepspeed.runtime.sequence_parallel import ulysses_sp
def sig(f):
    return [(p.name, repr(p.default)) for p in inspect.signature(f).parameters.values()]
print(json.dumps([sig(ulysses_sp.sequence_tiled_compute),
                  sig(ulysses_sp.TiledMLP.forward)[1:], sig(ulysses_sp.TiledFusedLogitsLoss.forward)[1:]]))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)
def test_tiling_names_have_deepspeeds_signatures() -> None:
    """sequence_tiled_compute's parameters and the arguments TiledMLP.apply /
    TiledFusedLogitsLoss.apply take are DeepSpeed 0.19.8's (names and defaults)."""
    root = str(Path(__file__).resolve().parents[2])
    out = []
    for ours in (True, False):
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        env.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        code = _NAMES.format(root=root, ours=ours)
        if ours:  # our forward carries the appended parameters; apply has DeepSpeed's arguments
            code = code.replace("ulysses_sp.TiledMLP.forward)[1:]", "ulysses_sp.TiledMLP.apply)")
            code = code.replace(
                "ulysses_sp.TiledFusedLogitsLoss.forward)[1:]",
                "ulysses_sp.TiledFusedLogitsLoss.apply)",
            )
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1]
