"""init_inference: DeepSpeed's keys, dtype / int8 / checkpoint preparation, and the errors
that must come before any model work."""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.config import ConfigError
from slipstream.inference import InferenceConfig, init_inference
from slipstream.quant import QuantLinear
from tests._tiny_models import left_padded, tiny_gpt2, tiny_llama


def test_deepspeed_keys_are_accepted_and_init_inference_is_exported():
    engine = slipstream.init_inference(
        tiny_llama(), tensor_parallel={"tp_size": 1}, dtype=torch.float32,
        replace_with_kernel_inject=True, max_tokens=40, enable_cuda_graph=False,
    )  # fmt: skip
    assert isinstance(engine, slipstream.InferenceEngine)
    assert engine.config.max_out_tokens == 40 and engine.config.replace_with_kernel_inject
    ids, mask = left_padded([4, 2])
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=3, ignore_eos=True)
    assert out.shape == (2, 7) and torch.equal(out[:, :4], ids)
    assert engine(input_ids=ids).logits.shape == (2, 4, 96)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_paralel": {"tp_size": 1}}, "did you mean 'tensor_parallel'"),
        ({"max_out_token": 8}, "did you mean 'max_out_tokens'"),
        ({"tensor_parallel": {"tp_size": 2}}, "tp_size=2 needs a multiple of 2 processes"),
        ({"mp_size": 2}, "tp_size=2 needs a multiple of 2 processes, but this job has 1"),
        ({"tp": {"tp_size": 3}}, "tp_size=3 does not divide .*num_attention_heads=4"),
        ({"mp_size": 4}, "tp_size=4 does not divide .*num_key_value_heads=2"),
        ({"mp_size": 2, "quant": "w8a8-int"}, "quantization .* with tensor_parallel.tp_size=2"),
        ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "contradicts"),
        ({"dtype": "fp8"}, "'fp8' is not a dtype"),
        ({"zero": {"stage": 3}}, "ZeRO-Inference"),
        ({"quant": "w9a9"}, "quant='w9a9' is unknown"),
        ({"quant": {"enabled": True, "weight": {"num_bits": 3}}}, "num_bits=3"),
        ({"use_triton": True}, "use_triton"),
        ({"checkpoint": "/nonexistent/model.safetensors"}, "does not exist"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        init_inference(tiny_llama(), **kwargs)


def test_config_and_kwargs_must_agree():
    with pytest.raises(ConfigError, match="give it once"):
        init_inference(tiny_llama(), {"max_out_tokens": 10}, max_out_tokens=20)
    cfg = InferenceConfig(max_out_tokens=10)
    assert init_inference(tiny_llama(), cfg, max_out_tokens=10).config.max_out_tokens == 10


def test_dtype_casts_and_int8_quantizes():
    bf16 = init_inference(tiny_llama(), dtype="bf16").module
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    int8 = init_inference(tiny_llama(), dtype="int8").module
    assert isinstance(int8.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(int8.lm_head, torch.nn.Linear)  # the LM head stays float


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_int8_weights_stay_close_to_fp32(build):
    """Bound: teacher-forced logits within 3% relative L2 error of fp32, and the same top-1
    token at >= 90% of positions (measured: ~0.8% and 100% on these models)."""
    model = build()
    ids, mask = left_padded([7, 3, 5, 1])
    e32, e8 = init_inference(copy.deepcopy(model)), init_inference(model, dtype="int8")
    out = e32.generate(ids, attention_mask=mask, max_new_tokens=12, ignore_eos=True)
    full = torch.cat([mask, torch.ones(4, 12, dtype=torch.long)], 1)
    kw = dict(input_ids=out, attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp(min=0))
    l32, l8 = e32(**kw).logits[:, 6:], e8(**kw).logits[:, 6:]
    assert ((l8 - l32).norm() / l32.norm()).item() < 0.03
    assert (l8.argmax(-1) == l32.argmax(-1)).float().mean().item() >= 0.9


def test_checkpoint_directory_is_loaded(tmp_path):
    """Weights saved by save_pretrained (tied LM head stored once) load into a fresh model."""
    trained, fresh = tiny_llama(seed=0), tiny_llama(seed=1)
    trained.save_pretrained(tmp_path)
    engine = init_inference(fresh, checkpoint=str(tmp_path))
    for (name, a), b in zip(engine.module.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
    other = tiny_gpt2()
    with pytest.raises(ConfigError, match="does not match"):
        init_inference(other, checkpoint=str(tmp_path))


class _Calls:
    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.n += 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 30}, "more than max_out_tokens=32"),
        ({"num_beams": 2}, "num_beams=2 is not supported"),
        ({"max_new_token": 3}, "did you mean 'max_new_tokens'"),
        ({"do_sample": True, "temperature": 0.0}, "temperature=0.0"),
        ({"do_sample": True, "top_p": 1.5}, "top_p=1.5"),
        ({"stop_strings": ["\n"]}, "need the tokenizer"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens=9"),
        ({"seed": 1, "generator": torch.Generator()}, "either seed or generator"),
        ({"attention_mask": torch.tensor([[1, 1, 0, 0, 0]] * 2)}, "right-padded"),
        ({"attention_mask": torch.tensor([[0] * 5, [1] * 5])}, "row 0 is all padding"),
        ({"input_ids": torch.ones(5, dtype=torch.long)}, "must be a \\[batch, length\\]"),
    ],
)
def test_bad_generate_input_fails_before_any_work(kwargs, message):
    model = tiny_llama()
    calls = _Calls(model)
    engine = init_inference(model, max_out_tokens=32)
    args = {"input_ids": torch.full((2, 5), 7), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        engine.generate(**args)
    assert calls.n == 0


def test_prompt_longer_than_the_model_context_is_refused():
    engine = init_inference(tiny_llama(), max_out_tokens=1000)  # the context is 64
    with pytest.raises(ConfigError, match="context of 64 positions"):
        engine.generate(torch.full((1, 60), 7), max_new_tokens=8)


def test_non_hf_module_is_refused_with_the_reason():
    engine = init_inference(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="neither slipstream's GPT nor a Hugging Face causal LM"):
        engine.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)


def test_cuda_graph_is_refused_where_it_cannot_run() -> None:
    """enable_cuda_graph needs a Hugging Face causal LM on a CUDA device (tests/cuda runs it)."""
    from slipstream.models import GPT, GPTConfig
    from tests._tiny_models import tiny_llama

    with pytest.raises(ConfigError, match="not a CUDA device"):
        init_inference(tiny_llama(), enable_cuda_graph=True)
    with pytest.raises(ConfigError, match="GPT is not a Hugging Face causal LM"):
        init_inference(GPT(GPTConfig.preset("tiny")), enable_cuda_graph=True)
