"""Ulysses for Hugging Face causal LMs (LLaMA, Qwen2/3, Mistral, GPT-2, OPT) with no model
changes: SP=2 equals one process in loss and parameters, GQA with fewer KV heads than P, the
refusal, the batch shard, DeepSpeed's ALST names."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.sequence import shard_causal_lm_batch
from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.sequence import _hf_workloads as w

# (model, ZeRO stage) at SP=2 on 2 ranks.
RUNS = [("llama_gqa2", 0), ("qwen2_kv1", 2), ("llama_eager", 3), ("mistral_gqa2", 1),
        ("qwen3_gqa2", 3), ("gpt2", 0), ("opt", 2)]  # fmt: skip
REFUSED = ["llama_heads3", "bert_mlm"]


@pytest.fixture(scope="module")
def world2():
    return run_world(w.world, 2, RUNS, REFUSED)


def test_hf_sp2_matches_single_process(world2):
    """Losses and parameters after 3 SGD steps (so gradients too) equal one process's, fp32
    (loss rtol 1e-5, params rtol 1e-5 / atol 2e-5); both ranks hold the same parameters."""
    for run in RUNS:
        got, ref = world2[0]["training"][run], w.reference_run(run[0])
        assert got["attn"].startswith("slipstream_ulysses_"), got["attn"]
        assert got["shapes"] == [(w.BATCH, w.SEQ // 2)], got["shapes"]
        assert got["params"].keys() == ref["params"].keys(), run
        assert_same_training(got, ref, f"SP=2 {run}", param_rtol=1e-5, param_atol=2e-5)
        other = world2[1]["training"][run]
        assert other["losses"] == got["losses"], run
        for name, p in got["params"].items():
            assert torch.equal(p, other["params"][name]), (run, name)


def test_heads_not_divisible_are_refused(world2):
    """3 query heads over SP=2: the error names the model, the head counts and the fix; a
    model that is not a causal LM (BERT MLM) is refused, naming it."""
    for rank in world2:
        msg = rank["refused"]["llama_heads3"]
        assert "LlamaForCausalLM" in msg, msg
        assert "num_attention_heads=3" in msg and "num_key_value_heads=3" in msg, msg
        assert "sequence_parallel_size that divides 3" in msg, msg
        msg = rank["refused"]["bert_mlm"]
        assert "BertForMaskedLM" in msg and "causal LMs" in msg, msg


def test_shard_causal_lm_batch_keeps_edge_targets():
    """Labels are shifted on the full sequence, so shard 0's last target is shard 1's first
    token; positions come from the full sequence; padding masks are refused."""
    ids = torch.arange(8).view(1, 8)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(1, 8)}
    s0, s1 = (shard_causal_lm_batch(batch, 2, r) for r in (0, 1))
    assert s0["shift_labels"].tolist() == [[1, 2, 3, 4]]
    assert s1["shift_labels"].tolist() == [[5, 6, 7, -100]]
    assert s1["position_ids"].tolist() == [[4, 5, 6, 7]] and "attention_mask" not in s1
    with pytest.raises(ValueError, match="not divisible by sequence_parallel_size=3"):
        shard_causal_lm_batch(batch, 3, 0)
    padded = dict(batch, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask has padding"):
        shard_causal_lm_batch(padded, 2, 0)


def test_deepspeed_alst_script_matches_single_process():
    """DeepSpeed's ALST names (register_with_transformers, initialize(mpu=), the loader
    adapter, the script's weighted loss) train Qwen2 with 1 KV head at SP=2, ZeRO-2, to the
    same losses and parameters as one process (fp32, rtol 1e-5 / atol 2e-5)."""
    per_rank = run_world(w.alst_world, 2, "qwen2_kv1", 2)
    ref = w.reference_run("qwen2_kv1")
    assert_same_training(per_rank[0], ref, "ALST SP=2", param_rtol=1e-5, param_atol=2e-5)
    assert per_rank[1]["losses"] == per_rank[0]["losses"]
    for rank in per_rank:  # a Hub kernel name is loaded first, then wrapped (not sdpa)
        want = {"calls": ["kernels-community/flash-attn2"], "wrapped": True}
        assert rank["hub"] == {**want, "sdpa_kept": True, "groups_not_none": True}, rank["hub"]
        refused = rank["adapter"]  # the loader adapter names what is wrong with a batch
        assert "requires `position_ids`" in refused["no_positions"], refused
        assert "seqlen=15 isn't divisible by sp-size=2" in refused["odd_length"], refused
        assert (
            "labels's shape (1, 7) must match input_ids's shape (1, 15)"
            in (refused["short_labels"])
        ), refused


def test_register_refuses_a_model_configured_with_another_attention():
    """DeepSpeed's words, which its own test matches: the model (or a PEFT-like wrapper with
    a ``config``) runs sdpa, the call asks for flash_attention_2."""
    from types import SimpleNamespace

    from slipstream.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    wrapper = SimpleNamespace(config=w.make_model("llama_gqa2").config)
    with pytest.raises(ValueError, match="does not match model config attn_implementation='sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(wrapper, "flash_attention_2", 2, 1)


_SIGNATURES = """
import inspect, json, sys
sys.path.insert(0, {root!r})
if {ours}:
    from slipstream.runtime.sequence_parallel import ulysses_sp
else:
    from tests.compat._deepspeed import import_deepspeed
    import_deepspeed()
    from deepspeed.runtime.sequence_parallel import ulysses_sp
def sig(f):
    return [(p.name, repr(p.default), str(p.kind)) for p in inspect.signature(f).parameters.values()]
a, d = ulysses_sp.UlyssesSPAttentionHF, ulysses_sp.UlyssesSPDataLoaderAdapter
print(json.dumps([sig(a.__init__), sig(a.register_with_transformers), sig(a.forward),
                  sig(d.__init__)]))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)
def test_alst_names_have_deepspeeds_signatures():
    """UlyssesSPAttentionHF (init, register_with_transformers, forward) and
    UlyssesSPDataLoaderAdapter take DeepSpeed 0.19.8's parameters, names and defaults."""
    root = str(Path(__file__).resolve().parents[2])
    out = []
    for ours in (True, False):
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        env.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        proc = subprocess.run(
            [sys.executable, "-c", _SIGNATURES.format(root=root, ours=ours)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1]


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="Accelerate is not installed"
)
def test_hf_trainer_accelerate_ulysses_matches_single_process(tmp_path):
    """The HF Trainer with Accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    on slipstream (SLIPSTREAM_AS_DEEPSPEED=1: DeepSpeed's ALST names, initialize(mpu=),
    deepspeed.utils.groups) logs the same 3 losses as a one-process Trainer (rtol 1e-5)."""
    old = os.environ.get("SLIPSTREAM_AS_DEEPSPEED")
    os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    try:
        sp = run_world(w.trainer_losses, 2, str(tmp_path / "sp"), 2)
        one = run_world(w.trainer_losses, 1, str(tmp_path / "one"), 1)[0]
    finally:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = old
    assert len(one) == w.STEPS
    for rank in sp:
        torch.testing.assert_close(torch.tensor(rank), torch.tensor(one), rtol=1e-5, atol=0)
