"""VisualChat: MMCA inside GPT and HF LLaMA, input assembly, frozen parts, KV-cache chat."""

from __future__ import annotations

import pytest
import torch

from slipstream.models.gpt import GPT, GPTConfig
from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.multimodal import IMAGE, PAD, TEXT, VisualChat, VisualChatConfig, use_mmca_

IMG = 40  # placeholder id, beyond the LM vocabulary of 40
VIT = ViTSegConfig.preset("tiny", patch_size=4, in_channels=1, hidden_size=16, max_tokens=4)


def _gpt(vocab: int = 40) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=vocab, hidden_size=32, max_seq_len=64))


def _llama():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _chat(lm: torch.nn.Module, mode: str = "paper", new: int = 2, lora: int = 0) -> VisualChat:
    torch.manual_seed(1)
    cfg = VisualChatConfig(image_token_id=IMG, image_size=8, num_new_tokens=new, mmca_mode=mode,  # type: ignore[arg-type]
                           lm_lora_rank=lora)  # fmt: skip
    chat = VisualChat(ViTSegmenter(VIT), lm, cfg)
    with torch.no_grad():  # nonzero B, so the adapters change the LM
        for name, p in chat.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0.0, 0.2)
    return chat


def _batch():  # type: ignore[no-untyped-def]
    ids = torch.tensor([[1, 2, IMG, 3, IMG, 4, 5, 6], [7, IMG, 8, 9, 10, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    labels = torch.tensor([[-100] * 5 + [4, 5, 6], [-100] * 3 + [9, 10, -100, -100, -100]])
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    return ids, images, torch.tensor([2, 1]), mask, labels


def test_mmca_cores_without_images_equal_the_plain_gpt_bitwise() -> None:
    ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _gpt()(ids)
    gpt = _gpt()
    types = use_mmca_(gpt, "paper")
    types.value = torch.full_like(ids, TEXT)
    assert torch.equal(gpt(ids), plain)


def test_hf_llama_mmca_without_images_equals_its_sdpa_attention() -> None:
    lm = _llama()
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = lm(input_ids=ids).logits
    chat = _chat(lm, new=0)
    got = lm(input_ids=ids, token_types=torch.full_like(ids, TEXT)).logits
    assert chat.lm.config._attn_implementation == "slipstream_mmca"
    torch.testing.assert_close(got, ref)


def test_assembly_replaces_placeholders_in_order_with_types_and_labels() -> None:
    chat = _chat(_gpt())
    ids, images, counts, mask, labels = _batch()
    a = chat.assemble(ids, images, counts, mask, labels)
    n = chat.vision.num_tokens  # 4 tokens per 8x8 image with 4x4 patches
    assert a.embeds.shape[1] % 8 == 0 and a.embeds.shape[1] >= 8 + 2 * (n - 1)
    want0 = [TEXT, TEXT] + [IMAGE] * n + [TEXT] + [IMAGE] * n + [TEXT] * 3
    assert a.token_types[0, : len(want0)].tolist() == want0
    assert (a.token_types[0, len(want0) :] == PAD).all()
    want1 = [TEXT] + [IMAGE] * n + [TEXT] * 3
    assert a.token_types[1, : len(want1)].tolist() == want1
    assert (a.token_types[1, len(want1) :] == PAD).all()
    feats = chat.projection(chat.vision(images))
    torch.testing.assert_close(a.embeds[0, 2 : 2 + n], feats[0])
    torch.testing.assert_close(a.embeds[0, 3 + n : 3 + 2 * n], feats[1])
    torch.testing.assert_close(a.embeds[1, 1 : 1 + n], feats[2])
    assert a.labels is not None
    assert a.labels[0, len(want0) - 3 :].tolist()[:3] == [4, 5, 6]
    assert (a.labels[a.token_types != TEXT] == -100).all()
    assert a.labels[1, 1 + n + 1 : 1 + n + 3].tolist() == [9, 10]


@pytest.mark.parametrize(("mode", "lora"), [("paper", 0), ("causal", 0), ("reference_code", 2)])
def test_only_projection_new_token_rows_and_lora_get_gradients(mode: str, lora: int) -> None:
    chat = _chat(_gpt(), mode, lora=lora)
    ids, images, counts, mask, labels = _batch()
    ids[0, 0] = 41  # a new special token (row 1 of the trainable rows)
    chat(ids, images, counts, labels, mask).backward()
    trainable = {n for n, p in chat.named_parameters() if p.requires_grad}
    adapters = {f"lm.layers.{i}.{part}.lora_{ab}" for i in range(2) for ab in "ab"
                for part in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert trainable == {"embed.new_rows", "projection.0.weight", "projection.0.bias",
                         "projection.1.weight", "projection.1.bias"} | (adapters if lora else set())  # fmt: skip
    assert all(chat.get_parameter(n).grad is not None for n in trainable)
    assert all(p.grad is None for n, p in chat.named_parameters() if n not in trainable)
    grad = chat.embed.new_rows.grad
    assert grad is not None and grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0
    assert chat.projection[0].weight.grad.abs().sum() > 0  # type: ignore[union-attr]


def test_modes_differ_only_where_images_are() -> None:
    ids, images, counts, mask, labels = _batch()
    with torch.no_grad():
        losses = {m: _chat(_gpt(), m)(ids, images, counts, labels, mask).item() for m in
                  ("paper", "causal", "reference_code")}  # fmt: skip
    assert len(set(losses.values())) == 3
    text_only = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    none = torch.zeros(0, 1, 8, 8)
    same = {m: _chat(_gpt(), m)(text_only, none, torch.tensor([0]))[0] for m in ("paper", "causal")}
    assert torch.equal(same["paper"], same["causal"])


def test_bad_input_errors_name_the_sample() -> None:
    chat = _chat(_gpt())
    ids, images, counts, mask, labels = _batch()
    names = ["conv-a", "conv-b"]
    with pytest.raises(ValueError, match="sample 'conv-b' has 1 <image> placeholders but 2"):
        chat(ids, torch.rand(4, 1, 8, 8), torch.tensor([2, 2]), labels, mask, names)
    with pytest.raises(ValueError, match=r"images must be \[N, 1, 8, 8\].*got \(3, 3, 8, 8\)"):
        chat(ids, torch.rand(3, 3, 8, 8), counts, labels, mask, names)
    with pytest.raises(ValueError, match=r"images must be \[N, 1, 8, 8\].*got \(3, 1, 16, 16\)"):
        chat(ids, torch.rand(3, 1, 16, 16), counts, labels, mask, names)
    long = torch.cat([ids, torch.ones(2, 60, dtype=torch.long)], 1)
    long_mask = torch.cat([mask, torch.ones(2, 60, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match=r"sample 'conv-a' is 74 tokens .* context of 64"):
        chat(long, images, counts, None, long_mask, names)


@pytest.mark.parametrize(("lm", "lora"), [("gpt", 0), ("llama", 2)])
def test_chat_generation_equals_full_recomputation(lm: str, lora: int) -> None:
    """Greedy decoding (KV cache for LLaMA; LoRA fused while decoding) equals re-running the
    whole conversation (LoRA unfused)."""
    chat = _chat(_llama() if lm == "llama" else _gpt(), lora=lora).eval()
    ids, images, counts, mask, _ = _batch()
    ids, mask = ids[:1, :6], mask[:1, :6]
    images, counts = images[:2], counts[:1]
    new = chat.generate(ids, images, counts, max_new_tokens=5)
    full = ids
    for step in range(5):
        with torch.no_grad():
            logits = chat(full, images, counts)
        a = chat.assemble(full, images, counts)
        last = int((a.token_types[0] != PAD).nonzero().max())
        token = logits[0, last].argmax()
        assert int(token) == int(new[0, step])
        full = torch.cat([full, token.view(1, 1)], 1)


@pytest.mark.parametrize("lm", ["gpt", "llama"])
def test_ended_rows_repeat_eos_and_generation_stops_when_all_ended(lm: str) -> None:
    """VisualChat runs the shared decode loop with its convention: a row that emitted EOS
    repeats it (the loop writes the pad token; VisualChat's is its EOS) and decoding stops
    when every row has ended; before its EOS a row has the tokens it has without one."""
    chat = _chat(_llama() if lm == "llama" else _gpt()).eval()
    ids, images, counts, mask, _ = _batch()
    free = chat.generate(ids, images, counts, max_new_tokens=8, attention_mask=mask)
    eos = int(free[0, 1])
    out = chat.generate(
        ids, images, counts, max_new_tokens=8, attention_mask=mask, eos_token_id=eos
    )
    ends = []
    for got, want in zip(out, free):
        hits = (want == eos).nonzero()
        end = int(hits[0]) if hits.numel() else want.numel() - 1
        ends.append(end)
        assert torch.equal(got[: end + 1], want[: end + 1])
        assert bool((got[end + 1 :] == eos).all())
    assert out.shape[1] == max(ends) + 1


def test_repetition_penalty_is_refused_not_ignored() -> None:
    """The prompt is embeddings (image tokens have no ids), so the shared loop's repetition
    penalty cannot apply; it was silently ignored before, it is refused now."""
    from slipstream.inference import SamplingPolicy

    chat = _chat(_gpt()).eval()
    ids, images, counts, mask, _ = _batch()
    policy = SamplingPolicy(repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.2 is not supported"):
        chat.generate(ids, images, counts, max_new_tokens=2, attention_mask=mask, sampling=policy)


def test_engine_zero2_trains_only_the_projection_and_keeps_no_state_for_frozen_parts() -> None:
    import slipstream

    chat = _chat(_gpt())
    frozen = {n: p.detach().clone() for n, p in chat.named_parameters() if not p.requires_grad}
    trainable = [p for p in chat.parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    engine, optimizer, _, _ = slipstream.initialize(
        model=chat, model_parameters=trainable, config=config
    )
    ids, images, counts, mask, labels = _batch()
    losses = []
    for _ in range(6):
        loss = engine(ids, images, counts, labels, mask)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = optimizer.state_bytes()  # type: ignore[union-attr]
    # AdamW: exp_avg + exp_avg_sq in fp32 for the trainable numel only (+ step counters).
    numel = sum(p.numel() for p in trainable)
    assert 8 * numel <= state <= 8 * numel + 64 * len(trainable)
    assert all(torch.equal(p, frozen[n]) for n, p in chat.named_parameters() if n in frozen)
    assert losses[-1] < losses[0]
    engine.destroy()


def test_engine_zero3_bf16_trains_projection_and_lora_and_nothing_else() -> None:
    import slipstream

    chat = _chat(_gpt(), lora=2)
    frozen = {n: p.detach().to(torch.bfloat16) for n, p in chat.named_parameters()
              if not p.requires_grad}  # fmt: skip
    trainable = {n: p for n, p in chat.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
    }
    engine, optimizer, _, _ = slipstream.initialize(
        model=chat, model_parameters=list(trainable.values()), config=config
    )
    ids, images, counts, mask, labels = _batch()
    ids[0, 0] = 41  # a new special token, so embed.new_rows trains too
    losses = []
    for _ in range(6):
        loss = engine(ids, images, counts, labels, mask)
        engine.backward(loss)
        assert all(p.grad is None for n, p in chat.named_parameters() if n in frozen)
        engine.step()
        losses.append(loss.item())
    numel = sum(p.numel() for p in start.values())
    # AdamW exp_avg + exp_avg_sq and the fp32 master copy, for the trainable numel only.
    assert 8 * numel <= optimizer.state_bytes() <= 8 * numel + 64 * len(start)  # type: ignore[union-attr]
    assert optimizer.master_bytes() == 4 * numel  # type: ignore[union-attr]
    for n, p in chat.named_parameters():
        if n in frozen:
            assert p.dtype == torch.bfloat16 and torch.equal(p, frozen[n]), n
    assert losses[-1] < losses[0]
    with engine.gathered_for_generation():
        moved = [n for n, p in chat.named_parameters() if n in start
                 and not torch.equal(p.float(), start[n].to(torch.bfloat16).float())]  # fmt: skip
    assert set(moved) == set(start)
    engine.destroy()
