"""Tensor parallelism (alone and with ZeRO over data-parallel ranks) matches one process."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.parallel import _tp_workloads as w

# (model, tp, ZeRO stage, sequence_parallel, gradient clipping)
RUNS2 = [
    ("gpt", 2, 0, False, None),
    ("gpt", 2, 1, True, 0.05),
    ("gpt_tied", 2, 0, False, None),
    ("llama", 2, 0, False, None),
    ("gpt2", 2, 0, False, None),
    ("gpt_ckpt", 2, 2, False, None),
]
RUNS4 = [
    ("gpt", 4, 0, False, None),
    ("gpt", 4, 3, True, None),
    ("gpt", 2, 1, False, None),
    ("gpt", 2, 2, False, 0.05),
    ("gpt", 2, 3, False, None),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(w.world2, 2, RUNS2, str(tmp_path_factory.mktemp("tp_ckpt")))


@pytest.fixture(scope="module")
def world4():
    return run_world(w.world4, 4, RUNS4)


@pytest.fixture(scope="module")
def references():
    keys = {(_ref_kind(r[0]), r[4]) for r in RUNS2 + RUNS4}
    return {k: w.reference_run(*k) for k in keys}


def _ref_kind(kind):
    return "gpt" if kind == "gpt_ckpt" else kind  # checkpointing does not change the math


def _check_layers(per_rank):
    for rank, res in enumerate(per_rank):
        layers = res["layers"]
        y, ref, dx, ref_dx = layers["mlp"]
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank} MLP output")
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for got, want in layers["mlp_grads"]:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(*layers["embedding"], rtol=0, atol=0)
        loss, ref_loss, grad, ref_grad = layers["ce"]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        biggest, full = layers["ce_max_numel"]
        # Nothing of [tokens, vocab] size exists on any rank: only [tokens, vocab / tp].
        assert biggest <= full // len(per_rank), (biggest, full)


def _check_runs(results, references, runs):
    for run in runs:
        got, ref = results[run], references[(_ref_kind(run[0]), run[4])]
        assert got["params"].keys() == ref["params"].keys(), run
        assert_same_training(got, ref, str(run), param_atol=2e-5)
    # The runs really trained (the loss moved) and clipping really clipped.
    ref = references[("gpt", None)]["losses"]
    assert ref[-1] < ref[0] - 0.02
    assert references[("gpt", 0.05)]["losses"] != ref


def test_tp2_layers_and_loss_match_full(world2):
    _check_layers(world2)


def test_tp4_layers_and_loss_match_full(world4):
    _check_layers(world4)


def test_tp2_training_matches_single_process(world2, references):
    """TP=2 on the reference GPT (with Megatron-SP + ZeRO-1 + clipping, tied embeddings)
    and on HF LLaMA and GPT-2 models under the automatic plan."""
    _check_runs(world2[0]["runs"], references, RUNS2)


def test_tp4_and_tp2_dp2_with_zero_match_single_process(world4, references):
    _check_runs(world4[0]["runs"], references, RUNS4)


def test_dropout_streams(world2):
    res = [r["rng"] for r in world2]
    masks = res[0]["masks"]
    assert torch.equal(masks[0][0], masks[1][0]), "default stream must match across TP ranks"
    assert not torch.equal(masks[0][1], masks[1][1]), "TP stream must differ across TP ranks"
    assert torch.equal(masks[0][2], masks[1][2]), "fork() must not advance the default stream"
    for sp in (False, True):
        inputs, norms, moved = res[0]["streams"][sp]
        if not sp:  # replicated residual stream: identical on both TP ranks
            torch.testing.assert_close(inputs[0], inputs[1], rtol=0, atol=0)
        else:  # sequence-split: two different halves of the sequence
            assert not torch.equal(inputs[0], inputs[1])
        torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0)
        assert moved > 0, "the norm weights should have been trained"


def test_checkpoint_resume_under_tp(world2):
    for res in world2:
        ck = res["checkpoint"]
        torch.testing.assert_close(ck["resumed"], ck["straight"], rtol=1e-6, atol=0)
        assert ck["export_ok"], "save_16bit_model must write the full (unsharded) tensors"


@pytest.mark.parametrize(
    "config, fragment",
    [
        (
            {
                "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True},
                "activation_checkpointing": {"partition_activations": True},
            },
            "already split along the sequence",
        ),
        ({"tensor_parallel": {"sequence_parallel": True}}, "set autotp_size >= 2"),
        ({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}, "tp_overlap_comm"),
    ],
)
def test_tp_config_errors(config, fragment):
    from slipstream.config import ConfigError
    from slipstream.config.loader import parse_config

    with pytest.raises(ConfigError, match=fragment):
        parse_config({"train_batch_size": 2, **config}, dp_world_size=1)


def test_tp_plan_errors_name_the_module_and_size():
    """Indivisible sizes fail before any weight is touched, naming what does not divide."""
    from slipstream.config import ConfigError
    from slipstream.models import GPT
    from slipstream.models.gpt_plans import gpt_tp_plan
    from slipstream.parallel.tensor.apply import _check_heads

    model = GPT(w.gpt_config(num_heads=4, num_kv_heads=2))
    with pytest.raises(ConfigError, match=r"num_kv_heads = 2 is not divisible by .*autotp_size=4"):
        _check_heads(model, gpt_tp_plan(model), 4)
