"""init_compression prepares a model in place, the scheduler switches techniques on at their
offsets, and redundancy_clean leaves the compressed values in the weights."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.compression.compress import init_compression, redundancy_clean
from slipstream.compression.config import get_compression_config
from slipstream.compression.layers import CompressedEmbedding, CompressedLinear
from slipstream.compression.quantizers import quantize_weight
from slipstream.compression.scheduler import CompressionScheduler
from tests.compression import _models as m


def _prepared(**techniques: object) -> tuple[torch.nn.Module, CompressionScheduler, dict]:
    cfg = m.ds_config(**techniques)
    model = m.tiny_bert(0)
    init_compression(model, cfg)
    return model, CompressionScheduler(model, get_compression_config(cfg)), cfg


def test_prepared_in_place_with_the_same_parameters() -> None:
    """Every Linear/Embedding becomes compression-aware; objects and names are kept."""
    model = m.tiny_bert(0)
    before = dict(model.named_parameters())
    query = model.bert.encoder.layer[0].attention.self.query
    init_compression(model, m.ds_config(weight_quantization=m.weight_quantization()))
    assert model.bert.encoder.layer[0].attention.self.query is query
    assert isinstance(query, CompressedLinear)
    assert isinstance(model.bert.embeddings.word_embeddings, CompressedEmbedding)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_weight_quantization_starts_at_the_offset() -> None:
    """Before schedule_offset the forward is the float model's; from it on, the groups'
    weights are quantized at their target bits (8 for attention, 4 for the MLP)."""
    model, sched, _ = _prepared(weight_quantization=m.weight_quantization(offset=2))
    ref = m.tiny_bert(0)
    ids, _ = m.batch(0)
    sched.step(step_zero_check=True)
    sched.step()
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    sched.step()  # step 2
    inter = model.bert.encoder.layer[1].intermediate.dense
    query = model.bert.encoder.layer[1].attention.self.query
    assert inter.weight_quantization_enabled and inter.weight_bits == 4
    assert query.weight_bits == 8
    assert not model.classifier.weight_quantization_enabled  # in no group
    assert not torch.allclose(model(ids), ref(ids))
    w4 = inter._quantized_weight()
    assert w4.reshape(48, -1).unique(dim=None).numel() <= 16 * 48


def test_quantized_training_gradient_reaches_the_float_weights() -> None:
    model, sched, _ = _prepared(weight_quantization=m.weight_quantization(offset=0))
    sched.step(step_zero_check=True)
    ids, labels = m.batch(1)
    model(ids, labels).backward()
    query = model.bert.encoder.layer[0].attention.self.query
    assert query.weight.grad is not None and query.weight.grad.abs().sum() > 0


def test_redundancy_clean_stores_the_quantized_weights() -> None:
    """After cleaning, the weights hold the quantized values and a plain forward equals the
    quantization-aware forward."""
    model, sched, cfg = _prepared(weight_quantization=m.weight_quantization(offset=0))
    sched.step(step_zero_check=True)
    ids, _ = m.batch(2)
    qat = model(ids)
    inter = model.bert.encoder.layer[0].intermediate.dense
    want = quantize_weight(inter.weight.detach(), 4, "symmetric", 48)
    redundancy_clean(model, cfg)
    torch.testing.assert_close(inter.weight.detach(), want, rtol=0, atol=0)
    assert not inter.weight_quantization_enabled_in_forward
    torch.testing.assert_close(model(ids), qat)
    # The values are 4-bit: at most 16 levels in each of the 48 groups.
    groups = inter.weight.detach().reshape(48, -1)
    assert max(g.unique().numel() for g in groups) <= 16


def test_a_module_in_two_groups_is_an_error() -> None:
    wq = m.weight_quantization()
    wq["different_groups"]["wq2"]["modules"].append("attention.self.query")
    with pytest.raises(ValueError, match="already in another group"):
        init_compression(m.tiny_bert(0), m.ds_config(weight_quantization=wq))


def test_mpu_is_refused() -> None:
    with pytest.raises(ValueError, match="mpu"):
        init_compression(m.tiny_bert(0), m.ds_config(), mpu=object())


def test_a_path_config_and_a_wrapped_model() -> None:
    """DeepSpeedExamples pass the JSON path and sometimes a wrapper with ``.module``."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(m.ds_config(weight_quantization=m.weight_quantization()), f)
        f.flush()
        wrapped = Wrapper(m.tiny_bert(0))
        assert init_compression(wrapped, f.name) is wrapped
        assert isinstance(wrapped.module.classifier, CompressedLinear)


def test_model_copies_stay_independent() -> None:
    """A deep copy of a prepared model carries its own switches (the teacher/student set-up)."""
    model, sched, _ = _prepared(weight_quantization=m.weight_quantization(offset=0))
    twin = copy.deepcopy(model)
    sched.step(step_zero_check=True)
    assert not twin.bert.encoder.layer[0].attention.self.query.weight_quantization_enabled


def test_static_activation_range_moves_in_training_only() -> None:
    """Static calibration: the first batch sets the range, later ones move it with momentum
    0.95, eval keeps it; dynamic calibration quantizes each token with its own range."""
    model, sched, _ = _prepared(activation_quantization=m.activation_quantization(0, "static"))
    sched.step(step_zero_check=True)
    query = model.bert.encoder.layer[0].attention.self.query
    rng = query.activation_quantizer.x_min_max
    x1, x2 = torch.randn(2, 3, m.HIDDEN), 3 * torch.randn(2, 3, m.HIDDEN)
    query(x1)
    torch.testing.assert_close(rng, torch.stack([x1.min(), x1.max()]))
    query(x2)
    want = torch.stack([x1.min() * 0.95 + x2.min() * 0.05, x1.max() * 0.95 + x2.max() * 0.05])
    torch.testing.assert_close(rng, want)
    model.eval()
    query(10 * x2)
    torch.testing.assert_close(rng, want)
    assert "activation_quantizer.x_min_max" in dict(query.named_buffers())


def test_dynamic_activation_quantizes_each_token() -> None:
    model, sched, _ = _prepared(activation_quantization=m.activation_quantization(0))
    sched.step(step_zero_check=True)
    inter = model.bert.encoder.layer[0].intermediate.dense
    x = torch.randn(2, 3, m.HIDDEN)
    x[0, 0] *= 100  # one loud token must not coarsen the others
    from slipstream.compression.quantizers import symmetric_quantize

    want = torch.nn.functional.linear(
        symmetric_quantize(x, 8, None, None, 6), inter.weight, inter.bias
    )
    torch.testing.assert_close(inter(x), want)
    assert not torch.allclose(inter(x), torch.nn.functional.linear(x, inter.weight, inter.bias))


def test_layer_reduction_initialises_the_student_from_the_teacher() -> None:
    """Student layer i = teacher layer teacher_layer[i]; the other modules are copied whole;
    then the student is prepared like any model (the reference: the teacher's own tensors)."""
    teacher, student = m.tiny_bert(1), m.tiny_bert(2, layers=2)
    cfg = m.ds_config(
        layer_reduction=m.layer_reduction([1, 3]),
        weight_quantization=m.weight_quantization(offset=0),
    )
    init_compression(student, cfg, teacher_model=teacher)
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for key, value in s_state.items():
        if key.startswith("bert.encoder.layer.0."):
            t_key = key.replace("layer.0.", "layer.1.", 1)
        elif key.startswith("bert.encoder.layer.1."):
            t_key = key.replace("layer.1.", "layer.3.", 1)
        else:
            t_key = key
        torch.testing.assert_close(value, t_state[t_key], rtol=0, atol=0, msg=key)
    assert isinstance(student.bert.encoder.layer[1].intermediate.dense, CompressedLinear)


def test_layer_reduction_errors() -> None:
    cfg = m.ds_config(layer_reduction=m.layer_reduction([1, 3]))
    with pytest.raises(ValueError, match="pass the teacher"):
        init_compression(m.tiny_bert(2, layers=2), cfg)
    teacher = m.tiny_bert(1)
    teacher.classifier = torch.nn.Linear(m.HIDDEN, 5)
    with pytest.raises(ValueError, match="'classifier' and teacher 'classifier' differ"):
        init_compression(m.tiny_bert(2, layers=2), cfg, teacher_model=teacher)
    with pytest.raises(AttributeError, match="no attribute '3'"):
        init_compression(m.tiny_bert(2, layers=2), cfg, teacher_model=m.tiny_bert(1, layers=2))


def test_zero3_shards_are_refused() -> None:
    """A released ZeRO-3 parameter (empty, with ds_id) would give masks of nothing: refused."""
    model = m.tiny_bert(0)
    inter = model.bert.encoder.layer[0].intermediate.dense
    inter.weight.data = torch.empty(0)
    inter.weight.ds_id = 7  # type: ignore[attr-defined]
    cfg = m.ds_config(weight_quantization=m.weight_quantization())
    with pytest.raises(ValueError, match="ZeRO-3 shard"):
        init_compression(model, cfg)
    with pytest.raises(ValueError, match="consolidated weights"):
        redundancy_clean(model, cfg)
