"""AutoEP (the ``expert_parallel`` block): tiny Hugging Face Mixtral, Qwen3-MoE, Qwen3.5-MoE,
DeepSeek-V2, DeepSeek-V3 and MiniMax-M3 models converted to expert-parallel grouped experts
compute what the original model does (fp32), train through ``slipstream.initialize`` at
``autoep_size`` 2 like one process training the original on the global batch, and train
through the HF Trainer. One forked 2-rank world runs every multi-rank check."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.config.expert import ExpertParallelConfig
from slipstream.config.loader import read_config
from slipstream.moe import moe_layers
from slipstream.moe.autoep import (
    PRESETS,
    AutoEPExperts,
    AutoEPRouter,
    convert_hf_moe_,
    detect_preset,
)
from tests.distributed.harness import run_world
from tests.moe import _autoep_workloads as w

pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_converted_model_equals_original(preset: str) -> None:
    """autoep_size 1 in one process, the preset found from the model type: same logits, and a
    gradient that reaches the experts."""
    model = w.build(preset).eval()
    assert detect_preset(model) == preset
    ids = w.batch(0, 0)
    ref = model(input_ids=ids).logits
    conv = copy.deepcopy(model)
    replaced = convert_hf_moe_(conv, ExpertParallelConfig(enabled=True), 0)
    assert replaced and moe_layers(conv)
    assert all(type(m).__name__ != "AutoEPRouter" for m in conv.modules())  # HF's router kept
    torch.testing.assert_close(conv(input_ids=ids).logits, ref, **TOL)
    # HF key names and shapes are kept at autoep_size 1.
    assert {k: v.shape for k, v in conv.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }
    conv.train()
    conv(input_ids=ids, labels=ids).loss.backward()
    experts = next(m for m in conv.modules() if isinstance(m, AutoEPExperts))
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    # MiniMax-M3's experts run its clamped SwiGLU (the plain one would change the logits).
    assert (experts.clamp is not None) == (preset == "minimax_m3")


def test_minimax_activation_and_composite_types() -> None:
    """MiniMax-M3's clamped SwiGLU: the plain form gives other logits, and an
    expert_activation naming it is refused; a vision-language model type is refused with
    the text backbone's type, as DeepSpeed's presets do."""
    model = w.build("minimax_m3").eval()
    ids = w.batch(0, 2)
    conv = copy.deepcopy(model)
    convert_hf_moe_(conv, ExpertParallelConfig(enabled=True, expert_activation="swiglu_oai"), 0)
    torch.testing.assert_close(conv(input_ids=ids).logits, model(input_ids=ids).logits, **TOL)
    for m in conv.modules():
        if isinstance(m, AutoEPExperts):
            m.clamp = None
    assert not torch.allclose(conv(input_ids=ids).logits, model(input_ids=ids).logits, **TOL)
    with pytest.raises(ConfigError, match=r"'expert_parallel\.expert_activation' = 'swiglu'"):
        convert_hf_moe_(model, ExpertParallelConfig(enabled=True, expert_activation="swiglu"), 0)
    model.config.model_type = "minimax_m3_vl"
    with pytest.raises(ConfigError, match="'minimax_m3_vl_text'"):
        convert_hf_moe_(model, ExpertParallelConfig(enabled=True), 0)


def test_routing_keys_replace_the_router() -> None:
    """top_k / route_norm set in the block: the router is replaced and routes as the model
    configured that way would (Qwen3-MoE at top-1 without renormalisation)."""
    model = w.build("qwen3_moe").eval()
    want = copy.deepcopy(model)
    for layer in want.model.layers:
        layer.mlp.gate.top_k, layer.mlp.gate.norm_topk_prob = 1, False
    conv = copy.deepcopy(model)
    ep = ExpertParallelConfig(enabled=True, top_k=1, route_norm=False)
    convert_hf_moe_(conv, ep, 0)
    assert isinstance(conv.model.layers[0].mlp.gate, AutoEPRouter)
    ids = w.batch(0, 1)
    torch.testing.assert_close(conv(input_ids=ids).logits, want(input_ids=ids).logits, **TOL)


def test_keys_are_validated() -> None:
    base = {"train_batch_size": 1}
    block = {"enabled": True, "preset_model": "mixtral", "top_k": "auto", "score_func": "auto"}
    ok = read_config({**base, "expert_parallel": block})
    assert ok.expert_parallel.autoep_size == 1 and ok.expert_parallel.top_k is None
    bad = [
        ({"comm_backend": "deepep"}, "'expert_parallel.comm_backend' = 'deepep'"),
        ({"expert_activation": "gelu"}, "'expert_parallel.expert_activation' = 'gelu'"),
        ({"preset_model": "llama"}, "unknown preset"),
        ({"score_apply": "pre"}, "'expert_parallel.score_apply' = 'pre'"),
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
        ({"load_balance_coeff": 0.1}, "load_balance_coeff"),
        ({"typo": 1}, "unknown config key 'expert_parallel.typo'"),
    ]
    for block, match in bad:
        with pytest.raises(ConfigError, match=match):
            read_config({**base, "expert_parallel": {"enabled": True, **block}})
    model = w.build("mixtral")
    with pytest.raises(ConfigError, match=r"'expert_parallel\.autoep_size' = 3 does not divide"):
        convert_hf_moe_(model, ExpertParallelConfig(enabled=True, autoep_size=3), 0)
    with pytest.raises(ConfigError, match="no module matches moe_layer_pattern"):
        convert_hf_moe_(model, ExpertParallelConfig(enabled=True, moe_layer_pattern="x"), 0)
    model.model.layers[0].mlp.experts.gate_up_proj.data = torch.empty(0)  # as zero.Init leaves it
    with pytest.raises(ConfigError, match="partitioned by ZeRO-3"):
        convert_hf_moe_(model, ExpertParallelConfig(enabled=True), 0)


class _Alias:
    """SLIPSTREAM_AS_DEEPSPEED=1 for the ranks about to be spawned (the Trainer path)."""

    def __enter__(self) -> None:
        self.old = os.environ.get("SLIPSTREAM_AS_DEEPSPEED")
        os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if self.old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = self.old


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    pytest.importorskip("accelerate")
    with _Alias():
        yield run_world(w.world, 2, str(tmp_path_factory.mktemp("autoep")), timeout_s=500)


@pytest.mark.parametrize("case", ["qwen3_moe/ep2", "deepseek_v3/ep2", "mixtral/ep2/zero2"])
def test_engine_ep2_equals_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    """autoep_size 2 (Qwen3-MoE and DeepSeek-V3 at ZeRO-1, Mixtral at ZeRO-2): the first
    logits equal the unconverted model's; losses and parameters after 3 clipped SGD steps
    equal one process on the global batch."""
    _check(ranks, case)


def _check(ranks: list[dict[str, Any]], case: str) -> None:
    for res in ranks:
        r = res[case]
        assert r["converted"] >= 1
        torch.testing.assert_close(r["first"], r["first_ref"], **TOL)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4, abs=1e-5)
        assert r["params"].keys() == r["ref_params"].keys()
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref_params"][name], rtol=1e-4, atol=1e-5)
    if "ep2" in case:  # each rank holds half the experts, and different ones
        name = next(n for n in ranks[0][case]["params"] if n.endswith("gate_up_proj"))
        a, b = ranks[0][case]["params"][name], ranks[1][case]["params"][name]
        assert not torch.equal(a, b)


def test_hf_trainer(ranks: list[dict[str, Any]]) -> None:
    """TrainingArguments(deepspeed=config with expert_parallel): the same losses as the
    Trainer without AutoEP (experts replicated), on both ranks."""
    for res in ranks:
        (plain, none), (autoep, converted) = res["trainer"][False], res["trainer"][True]
        assert none == 0 and converted == 2  # both Mixtral layers run expert-parallel
        assert len(autoep) == 3
        assert autoep == pytest.approx(plain, rel=1e-4)


def _deepspeed_autoep_defaults() -> dict[str, Any]:
    """``key -> default`` of DeepSpeed's own ``parse_autoep_config``, read from its source
    (``param_dict.get("key", default)``) without importing DeepSpeed."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("DeepSpeed is not installed")
    path = Path(spec.origin).parent / "module_inject" / "auto_ep_config.py"
    if not path.exists():
        pytest.skip("this DeepSpeed has no AutoEP")
    out: dict[str, Any] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "param_dict"
            and len(node.args) == 2
        ):
            out[ast.literal_eval(node.args[0])] = ast.literal_eval(node.args[1])
    return out


def test_keys_and_defaults_are_deepspeeds() -> None:
    """Every key DeepSpeed 0.19.8's parser reads exists here with DeepSpeed's default
    ("auto" top_k is read as None; expert_w3 and load_balance_coeff are read by presence)."""
    ds = _deepspeed_autoep_defaults()
    assert len(ds) > 25
    ours = ExpertParallelConfig().model_dump()
    ds = {k: (None if k == "top_k" and v == "auto" else v) for k, v in ds.items()}
    assert {k: ours.get(k, "<missing>") for k in ds} == ds
    assert {"expert_w3", "load_balance_coeff"} <= ours.keys()
