"""ZeRO-3 partitions at initialize the parameters made outside zero.Init (a resized embedding,
an untied lm_head rebuilt by the resize, a head added after loading), in the training dtype,
and trains like the same model built without zero.Init."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.zero import _late_params_workloads as w

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for name, tie in (("tied", True), ("untied", False)):
        path = str(tmp_path_factory.mktemp(name))
        w.save_tiny_llama(path, tie)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def results(dirs: dict[str, str]) -> Iterator[dict[str, Any]]:
    old = os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"  # HfDeepSpeedConfig imports `deepspeed`
    try:
        yield run_world(w.all_cases, 2, dirs, timeout_s=400)[0]
    finally:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED")
        if old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = old


def _reference(case: str, model_dir: str, start: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same model built without zero.Init, from the engine's starting values: one
    process, the whole global batch, plain AdamW."""
    from transformers import AutoModel, AutoModelForCausalLM

    if case.startswith("head"):
        base = AutoModel.from_pretrained(model_dir)
        model: torch.nn.Module = w.ValueHead(base, base.config.hidden_size)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.resize_token_embeddings(w.VOCAB + w.ADDED)
    model.load_state_dict(start, strict=False)  # a tied lm_head is the embedding's key
    opt = torch.optim.AdamW(model.parameters(), lr=w.LR, weight_decay=0.0)
    losses = []
    for x in w.batches(2, w.vocab_of(case)):
        loss = sum(w.loss_of(model, case, x[r * w.MICRO : (r + 1) * w.MICRO]) for r in (0, 1))
        loss = loss / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "final": final, "model": model}


@pytest.mark.parametrize("case", ["resize_tied", "resize_untied", "head", "head_value"])
def test_trains_like_the_model_built_without_zero_init(
    results: dict[str, Any], dirs: dict[str, str], case: str
) -> None:
    """fp32: losses and parameters after 3 steps equal the single-process run (1e-5)."""
    got = results[case]
    assert not isinstance(got, str), got
    assert got["late"], "the case must leave parameters outside zero.Init"
    assert got["partitioned"]
    path = dirs["tied" if case == "resize_tied" else "untied"]
    ref = _reference(case, path, got["start"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    for name, value in ref["final"].items():
        torch.testing.assert_close(got["final"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_resize_keeps_the_loaded_rows_and_the_tie(
    results: dict[str, Any], dirs: dict[str, str]
) -> None:
    """The resized embedding starts with the loaded rows; the tie survives initialize."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(dirs["tied"]).get_input_embeddings().weight
    for case in ("resize_tied", "resize_untied"):
        got = results[case]
        assert not isinstance(got, str), got
        embed = got["start"]["model.embed_tokens.weight"]
        assert embed.shape == (w.VOCAB + w.ADDED, 32)
        if case == "resize_tied":
            assert torch.equal(embed[: w.VOCAB], loaded.detach())
    assert results["resize_tied"]["tied"] is True
    assert results["resize_untied"]["tied"] is False
    assert "lm_head.weight" in results["resize_untied"]["late"]


def test_added_head_takes_the_training_dtype(results: dict[str, Any]) -> None:
    """bf16: the fp32 v_head made after loading is partitioned in bf16 like the rest, and the
    first loss is the fp32 run's up to bf16 rounding (1e-2; later steps drift apart at this
    learning rate)."""
    got = results["head_bf16"]
    assert not isinstance(got, str), got
    assert got["late"] == ["v_head.weight"]
    assert set(got["dtypes"].values()) == {"torch.bfloat16"}
    fp32 = results["head"]["losses"]
    assert got["losses"][0] == pytest.approx(fp32[0], rel=1e-2)
    assert all(math.isfinite(x) for x in got["losses"])


def test_a_method_other_than_forward_gathers_what_it_runs(
    results: dict[str, Any], dirs: dict[str, str]
) -> None:
    """DeepSpeed-Chat's critic: a ZeRO-3 value model trained (the ``head_value`` case above)
    and then scored through ``forward_value``, a method other than ``forward`` that calls the
    submodules itself, so no hook of the root module fires. Each submodule gathers the
    parameters it runs, as in DeepSpeed: after training, the scores equal the single-process
    model's (1e-5) and the root's parameters are released again afterwards."""
    got = results["head_value"]
    assert not isinstance(got, str), got
    ref = _reference("head_value", dirs["untied"], got["start"])
    base = ref["model"]
    with torch.no_grad():
        want = base.forward_value(got["scored"]["x"])
    torch.testing.assert_close(got["scored"]["values"], want, rtol=1e-5, atol=1e-5)
    assert "rwtransformer.embed_tokens.weight" in got["scored"]["released"]
    assert "v_head.weight" in got["scored"]["released"]
