"""Conversation format, template, answer-only labels, blending and the digits demo set."""

from __future__ import annotations

import json
import random

import pytest
import torch

from slipstream.multimodal.data import (
    Conversation,
    Turn,
    blend,
    collate,
    concatenate,
    encode,
    load_jsonl,
    render,
)
from slipstream.multimodal.digits import (
    DigitImages,
    WordTokenizer,
    answer_correct,
    chance,
    digit_dataset,
    majority,
)

TOK = WordTokenizer()


def _conv(cid: str, n_images: int, answer: str = "seven") -> Conversation:
    refs = tuple(f"digits:{i}" for i in range(n_images))
    return Conversation(cid, (Turn("What digit is shown in the new image ?", answer, refs),))


def test_jsonl_round_trip_and_relative_image_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    line = {"id": "c1", "source": "demo", "turns": [
        {"images": ["a.png", "b.png"], "question": "q one", "answer": "a one"},
        {"question": "q two", "answer": "a two"}]}  # fmt: skip
    (tmp_path / "d.jsonl").write_text(json.dumps(line) + "\n\n")
    [conv] = load_jsonl(tmp_path / "d.jsonl")
    assert conv.id == "c1" and conv.meta == {"source": "demo"}
    assert conv.images == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "turns": [{"question": "q"}]}\n')
    with pytest.raises(
        ValueError, match=r"bad.jsonl:1 turn 0: a turn needs 'question' and 'answer'"
    ):
        load_jsonl(tmp_path / "bad.jsonl")


def test_template_numbers_images_and_labels_only_answers() -> None:
    conv = Conversation("c", (
        Turn("What digit is shown in the new image ?", "seven", ("digits:0", "digits:1")),
        Turn("How many of the images show a 7 ?", "one", ("digits:2",)),
    ))  # fmt: skip
    text = "".join(t for t, _ in render(conv))
    assert text.index("### Image 1:\n<image>") < text.index("### Image 2:\n<image>")
    assert text.index("### Image 3:") > text.index("### Answer:")
    e = encode(conv, TOK, TOK.image_id, TOK.eos_id)
    assert e.input_ids.count(TOK.image_id) == 3
    answers = [i for i, lab in zip(e.input_ids, e.labels) if lab != -100]
    assert answers == [*TOK("seven"), TOK.eos_id, *TOK("one"), TOK.eos_id]
    assert all(lab in (-100, i) for i, lab in zip(e.input_ids, e.labels))


def test_placeholder_count_mismatch_names_the_conversation() -> None:
    conv = Conversation("conv-9", (Turn("<image> What digit is shown ?", "seven", ("digits:0",)),))
    with pytest.raises(
        ValueError, match=r"conversation 'conv-9' has 2 <image> placeholders .* 1 images"
    ):
        encode(conv, TOK, TOK.image_id, TOK.eos_id)


def test_wrong_image_shape_names_the_conversation() -> None:
    e = encode(_conv("conv-3", 1), TOK, TOK.image_id, TOK.eos_id)
    with pytest.raises(
        ValueError, match=r"conversation 'conv-3': image 'digits:0' has shape \(3, 8, 8\)"
    ):
        collate([e], lambda ref: torch.zeros(3, 8, 8), image_shape=(1, 8, 8))


def test_concatenation_keeps_image_order_and_renumbers() -> None:
    singles = [_conv(f"s{i}", 1) for i in range(30)]
    singles = [Conversation(c.id, (Turn(c.turns[0].question, "seven", (f"digits:{i}",)),))
               for i, c in enumerate(singles)]  # fmt: skip
    merged = concatenate(singles, 3, random.Random(0))
    assert (
        sorted(len(m.images) for m in merged)[-1] == 3 and min(len(m.images) for m in merged) >= 1
    )
    assert sum(len(m.images) for m in merged) == 30
    for m in merged:
        parts = m.id.split("+")
        assert m.images == [f"digits:{p[1:]}" for p in parts]  # group order = image order
        text = "".join(t for t, _ in render(m))
        assert [text.count(f"### Image {n}:") for n in range(1, len(parts) + 2)] == [1] * len(
            parts
        ) + [0]


def test_blend_follows_the_ratios() -> None:
    a = [_conv(f"a{i}", 1) for i in range(50)]
    b = [_conv(f"b{i}", 1) for i in range(50)]
    out = blend({"a": a, "b": b}, {"a": 3.0, "b": 1.0}, 2000, random.Random(0))
    share = sum(c.id.startswith("a") for c in out) / len(out)
    assert 0.70 < share < 0.80
    with pytest.raises(ValueError, match="unknown: \\['c'\\]"):
        blend({"a": a}, {"c": 1.0}, 3, random.Random(0))


def test_digit_questions_are_answered_correctly_by_the_program() -> None:
    digits = DigitImages()
    convs = digit_dataset(digits, "train", 60, seed=0)
    held = digit_dataset(digits, "heldout", 60, seed=1)
    cut = int(0.7 * len(digits.labels))
    assert all(int(r.split(":")[1]) < cut for c in convs for r in c.images)
    assert all(int(r.split(":")[1]) >= cut for c in held for r in c.images)
    for conv in convs:
        labels = [digits.label(r) for r in conv.images]
        for turn, kind in zip(conv.turns, conv.meta["kinds"]):
            q = turn.question.split()
            if kind == "larger":
                i, j = int(q[3]) - 1, int(q[6]) - 1
                assert turn.answer == f"image {(i if labels[i] > labels[j] else j) + 1}"
            elif kind == "count":
                from slipstream.multimodal.digits import WORDS

                assert turn.answer == WORDS[labels.count(int(q[-2]))]
    assert {k for c in convs for k in c.meta["kinds"]} == {"digit", "larger", "count"}
    assert max(len(c.images) for c in convs) > 1
    many = digit_dataset(digits, "train", 600, seed=2)
    # balanced answers: the majority answer is about as good as a uniform guess
    assert majority(many)["count"] < chance(many)["count"] + 0.06
    assert majority(many)["larger"] < 0.6


def test_answer_correct_scores_whole_answers() -> None:
    labels = torch.tensor([[-100, -100, 5, 6, -100, 7, -100]])
    logits = torch.zeros(1, 7, 10)
    for pos, tok in ((1, 5), (2, 6), (4, 3)):  # answer 1 right, answer 2 wrong
        logits[0, pos, tok] = 1.0
    assert answer_correct(logits, labels) == [[True, False]]
