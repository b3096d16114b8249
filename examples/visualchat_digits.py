"""DeepSpeed-VisualChat in miniature, offline on a CPU: multi-image questions about
scikit-learn digits, answered by a frozen LM through a trained projection.

1. Pretrain a tiny ViT on digit classification, then freeze it (the vision encoder).
2. Pretrain a tiny GPT on the conversations written as text (each image as its digit's word,
   4 times), then freeze it (the language model that can already reason over digits).
3. Train the projection (Linear + LayerNorm) and LoRA adapters on the frozen LM through
   ``slipstream.initialize`` with ZeRO stage 2, attention switched to MMCA, on blended
   multi-image, multi-round conversations.
4. Report held-out answer accuracy per question kind against chance and the majority answer,
   and chat.

    python examples/visualchat_digits.py                       # MMCA (paper)
    python examples/visualchat_digits.py --compare             # + causal, reference_code
    python examples/visualchat_digits.py --lora-rank 0         # projection only
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch
import torch.nn.functional as F

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.multimodal import VisualChat, VisualChatConfig
from slipstream.multimodal.data import Conversation, collate, encode
from slipstream.multimodal.digits import (
    DigitImages,
    WordTokenizer,
    answer_correct,
    chance,
    digit_dataset,
    encode_as_text,
    majority,
)

PER_IMAGE = 4  # 8x8 digits in 4x4 patches


def pretrain_vision(digits: DigitImages, steps: int) -> ViTSegmenter:
    """A tiny ViT + linear probe on digit labels (train images only); returns the ViT."""
    torch.manual_seed(0)
    cfg = ViTSegConfig.preset("tiny", patch_size=4, in_channels=1, hidden_size=32, max_tokens=4)
    vit = ViTSegmenter(cfg)
    probe = torch.nn.Linear(32 * PER_IMAGE, 10)
    params = list(vit.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    chat = VisualChat(vit, GPT(GPTConfig.preset("tiny", vocab_size=8)), VisualChatConfig(0, 8))
    cut = int(0.7 * len(digits.labels))
    for _ in range(steps):
        idx = torch.randint(0, cut, (128,))
        loss = F.cross_entropy(
            probe(chat.vision(digits.images[idx]).flatten(1)), digits.labels[idx]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        feats = chat.vision(digits.images[cut:]).flatten(1)
        acc = (probe(feats).argmax(-1) == digits.labels[cut:]).float().mean().item()
    print(f"vision encoder: held-out digit accuracy of a linear probe {acc:.3f}")
    return vit


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def pretrain_lm(
    train: list[Conversation], tok: WordTokenizer, digits: DigitImages, steps: int
) -> GPT:
    """A tiny GPT trained on the text form of the training conversations (all tokens)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_seq_len=128))  # fmt: skip
    texts = [encode_as_text(c, tok, digits, PER_IMAGE).input_ids for c in train]
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    # 50 warm-up steps, then linear decay: the multi-image answers (compare, count) are learned
    # late, at small learning rates.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps)
    )
    rng = random.Random(0)
    for _step in range(steps):
        ids = _pad(rng.sample(texts, 32), -100)
        inputs = ids.clamp(min=0)[:, :-1]
        loss = gpt(inputs, ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    print(f"language model: text pretraining loss {loss.item():.3f} after {steps} steps")
    return gpt


def evaluate(model: VisualChat, batch: dict, convs: list[Conversation]) -> tuple[dict, float]:
    """Held-out exact-match answer accuracy per question kind, and the answer loss."""
    model.eval()
    with torch.no_grad():
        loss = model(**batch).item()
        labels = batch.pop("labels")
        a = model.assemble(batch["input_ids"], batch["images"], batch["image_counts"],
                           batch["attention_mask"], labels)  # fmt: skip
        logits = model.decoder.logits(a.embeds, a.token_types, a.position_ids)
        batch["labels"] = labels
    assert a.labels is not None
    model.train()
    return _per_kind(convs, answer_correct(logits, a.labels)), loss


def _per_kind(convs: list[Conversation], correct: list[list[bool]]) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for conv, row in zip(convs, correct):
        for kind, ok in zip(conv.meta["kinds"], row):
            hits.setdefault(kind, []).append(ok)
    acc = {k: sum(v) / len(v) for k, v in hits.items()}
    acc["all"] = sum(sum(v) for v in hits.values()) / sum(len(v) for v in hits.values())
    return acc


def text_accuracy(
    lm: GPT, convs: list[Conversation], tok: WordTokenizer, digits: DigitImages
) -> dict[str, float]:
    """The frozen LM's accuracy on the conversations written as text (each image as its
    digit's word): what a perfect projection could reach through causal attention."""
    encoded = [encode_as_text(c, tok, digits, PER_IMAGE) for c in convs]
    ids = _pad([e.input_ids for e in encoded], 0)
    labels = _pad([e.labels for e in encoded], -100)
    with torch.no_grad():
        logits = lm(ids)
    return _per_kind(convs, answer_correct(logits, labels))


def train_projection(
    mode: str, vit: ViTSegmenter, lm: GPT, data: dict, args: argparse.Namespace
) -> VisualChat:
    torch.manual_seed(0)
    tok = data["tok"]
    cfg = VisualChatConfig(image_token_id=tok.image_id, image_size=8, mmca_mode=mode,  # type: ignore[arg-type]
                           lm_lora_rank=args.lora_rank)  # fmt: skip
    model = VisualChat(vit, copy.deepcopy(lm), cfg)  # a fresh LM (and LoRA) per attention mode
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
    }
    engine, _, _, _ = slipstream.initialize(model=model, model_parameters=trainable, config=config)
    encoded = data["train_encoded"]
    rng = random.Random(1)
    for step in range(args.steps):
        batch = collate(rng.sample(encoded, args.batch), data["digits"], image_shape=(1, 8, 8))
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        if step % max(1, args.steps // 4) == 0 or step == args.steps - 1:
            print(f"  [{mode}] step {step:4d}  answer loss {loss.item():.3f}")
    engine.destroy()
    return model


KINDS = ("all", "digit", "larger", "count")


def _row(name: str, acc: dict[str, float], loss: float | None = None) -> str:
    cells = " | ".join(f"{acc[k]:.3f}" if k in acc else "" for k in KINDS)
    return f"| {name} | {cells} | {'' if loss is None else f'{loss:.3f}'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="projection training steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA on the LM; 0 = none")
    parser.add_argument("--vision-steps", type=int, default=200)
    parser.add_argument("--lm-steps", type=int, default=1200)
    parser.add_argument("--train", type=int, default=1500, help="training conversations")
    parser.add_argument("--heldout", type=int, default=600, help="held-out conversations")
    parser.add_argument("--compare", action="store_true", help="also causal and reference_code")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: a second thread costs more than it gains
    start = time.perf_counter()
    digits, tok = DigitImages(), WordTokenizer()
    train = digit_dataset(digits, "train", args.train, seed=0)
    heldout = digit_dataset(digits, "heldout", args.heldout, seed=1)
    data = {
        "digits": digits, "tok": tok,
        "train_encoded": [encode(c, tok, tok.image_id, tok.eos_id) for c in train],
    }  # fmt: skip
    held_batch = collate([encode(c, tok, tok.image_id, tok.eos_id) for c in heldout], digits)
    vit = pretrain_vision(digits, args.vision_steps)
    lm = pretrain_lm(train, tok, digits, args.lm_steps)
    rows = [
        _row("chance (uniform guess)", chance(heldout)),
        _row("majority answer", majority(heldout)),
        _row("LM on the text form (images as words)", text_accuracy(lm, heldout, tok, digits)),
    ]
    print("\n".join(rows))
    for mode in ("paper", "causal", "reference_code") if args.compare else ("paper",):
        model = train_projection(mode, vit, lm, data, args)
        acc, loss = evaluate(model, held_batch, heldout)
        rows.append(_row(f"{mode}, {args.steps} steps, LoRA rank {args.lora_rank}", acc, loss))
        print(rows[-1])
    print(f"\nheld-out answer accuracy ({len(heldout)} conversations)")
    print("\n| | all | digit | larger | count | answer loss |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    chat_demo(model, heldout[0], tok, digits)
    print(f"done in {time.perf_counter() - start:.0f} s")


def chat_demo(
    model: VisualChat, conv: Conversation, tok: WordTokenizer, digits: DigitImages
) -> None:
    """Ask the first held-out question and let the model answer (greedy, until EOS)."""
    first = Conversation(conv.id, conv.turns[:1])
    ids = encode(first, tok, tok.image_id, tok.eos_id).input_ids
    prompt = ids[: len(ids) - len(tok(first.turns[0].answer)) - 1]
    images = torch.stack([digits(r) for r in first.images])
    engine = slipstream.init_inference(model)
    out = engine.module.generate(torch.tensor([prompt]), images, torch.tensor([len(images)]),
                                 max_new_tokens=4, eos_token_id=tok.eos_id)  # fmt: skip
    truth = [digits.label(r) for r in first.images]
    print(f"chat: images show {truth}; Q: {first.turns[0].question}")
    print(f"chat: A: {tok.decode([t for t in out[0].tolist() if t != tok.eos_id])}")


if __name__ == "__main__":
    main()
