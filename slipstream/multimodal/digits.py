"""An offline VisualChat demonstration set from scikit-learn's bundled digits (8x8 grayscale),
with questions a program can check, most of which need several images:

* "digit": one image, "What digit is shown in the new image ?" -> "seven" (chance 1/10).
  These single-image samples are blended by concatenation into multi-image, multi-round
  conversations, as the released recipe does with LLaVA.
* "larger": 2-3 images, "Which of image A and image B shows the larger digit ?" ->
  "image B" (chance 1/2).
* "count": 2-3 images, "How many of the images show a D ?" -> "two" (chance 1/(n+1); the
  counts are balanced, so the majority answer is no better).

Images are referenced as ``"digits:<index>"``; :class:`DigitImages` loads them. Training and
held-out conversations use disjoint images. :class:`WordTokenizer` is a word-level tokenizer
over the fixed vocabulary of these prompts; :func:`encode_as_text` writes an image as words
(its digit, repeated once per image token), the text the frozen LM is pretrained on.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from slipstream.multimodal.data import (
    IMAGE_PLACEHOLDER,
    SYSTEM_PROMPT,
    Conversation,
    Encoded,
    Turn,
    blend,
    concatenate,
    render,
)

__all__ = [
    "WORDS",
    "DigitImages",
    "WordTokenizer",
    "answer_correct",
    "chance",
    "digit_dataset",
    "encode_as_text",
    "majority",
]

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_QUESTIONS = (
    "What digit is shown in the new image ?",
    "Which of image 1 and image 2 shows the larger digit ?",
    "How many of the images show a 0 ?",
)
_TOKEN = re.compile(r"###|\w+|[^\w\s]")


class WordTokenizer:
    """Word-level tokenizer of the demo's prompts: ``<pad>`` = 0, ``<eos>`` = 1, then words
    (a :class:`~slipstream.data.tokenizer.TextTokenizer`)."""

    pad_token_id: int | None = 0
    eos_token_id: int | None = 1

    def __init__(self) -> None:
        words: set[str] = set(WORDS) | {str(i) for i in range(10)} | {"image"}
        for text in (SYSTEM_PROMPT, "### Image 1:", "### Question:", "### Answer:", *_QUESTIONS):
            words.update(_TOKEN.findall(text))
        self.vocab = ["<pad>", "<eos>", *sorted(words)]
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.eos_id = 0, 1
        self.image_id = len(self.vocab)  # the placeholder sits just past the LM vocabulary

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self(text)

    def __call__(self, text: str) -> list[int]:
        try:
            return [self.ids[w] for w in _TOKEN.findall(text)]
        except KeyError as err:
            raise ValueError(
                f"WordTokenizer: {err.args[0]!r} is not in the demo vocabulary"
            ) from err

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[i] if i < len(self.vocab) else "<image>" for i in ids)


class DigitImages:
    """scikit-learn's 1,797 digits as ``[1, 8, 8]`` tensors in [0, 1], and their labels."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        self.images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.labels = torch.tensor(data.target)

    def __call__(self, ref: Any) -> torch.Tensor:
        return self.images[int(str(ref).split(":")[1])]

    def label(self, ref: Any) -> int:
        return int(self.labels[int(str(ref).split(":")[1])])


def _single(idx: int, digits: DigitImages) -> Conversation:
    ref = f"digits:{idx}"
    turn = Turn(_QUESTIONS[0], WORDS[digits.label(ref)], (ref,))
    return Conversation(f"digit-{idx}", (turn,), {"kinds": ["digit"], "options": [10]})


def _distinct(by_label: list[list[int]], labels: list[int], rng: random.Random) -> list[int]:
    """Distinct image indices, one per wanted label, in order."""
    chosen: list[int] = []
    for label in labels:
        candidates = [i for i in by_label[label] if i not in chosen]
        chosen.append(rng.choice(candidates))
    return chosen


def _larger(by_label: list[list[int]], rng: random.Random, n: int) -> Conversation:
    """2-3 images; compare two of them, which show different digits (answers balanced)."""
    k = rng.randint(2, 3)
    labels = [rng.randrange(10) for _ in range(k)]
    a, b = sorted(rng.sample(range(k), 2))
    labels[a], labels[b] = rng.sample(range(10), 2)
    idx = _distinct(by_label, labels, rng)
    refs = tuple(f"digits:{i}" for i in idx)
    larger = a if labels[a] > labels[b] else b
    turn = Turn(f"Which of image {a + 1} and image {b + 1} shows the larger digit ?",
                f"image {larger + 1}", refs)  # fmt: skip
    return Conversation(f"larger-{n}", (turn,), {"kinds": ["larger"], "options": [2]})


def _count(by_label: list[list[int]], rng: random.Random, n: int) -> Conversation:
    """2-3 images; how many show digit d. The count is uniform over 0..k, so always giving
    the most frequent answer is no better than a uniform guess."""
    k = rng.randint(2, 3)
    target, hits = rng.randrange(10), rng.randint(0, k)
    others = [d for d in range(10) if d != target]
    labels = [target] * hits + [rng.choice(others) for _ in range(k - hits)]
    rng.shuffle(labels)
    idx = _distinct(by_label, labels, rng)
    refs = tuple(f"digits:{i}" for i in idx)
    turn = Turn(f"How many of the images show a {target} ?", WORDS[hits], refs)
    return Conversation(f"count-{n}", (turn,), {"kinds": ["count"], "options": [k + 1]})


def digit_dataset(
    digits: DigitImages, split: str, num: int, seed: int = 0, max_group: int = 3
) -> list[Conversation]:
    """``num`` conversations from the "train" (first 70% of the images) or "heldout" split:
    a 1:1:1 blend of concatenated single-image samples (1..``max_group`` per conversation),
    "larger" and "count" conversations over 2-3 images."""
    cut = int(0.7 * len(digits.labels))
    pool = list(range(cut)) if split == "train" else list(range(cut, len(digits.labels)))
    by_label: list[list[int]] = [[] for _ in range(10)]
    for i in pool:
        by_label[digits.label(f"digits:{i}")].append(i)
    rng = random.Random(seed)
    singles = concatenate([_single(i, digits) for i in pool], max_group, rng)
    larger = [_larger(by_label, rng, n) for n in range(num)]
    count = [_count(by_label, rng, n) for n in range(num)]
    sources = {"single": singles, "larger": larger, "count": count}
    return blend(sources, dict.fromkeys(sources, 1.0), num, rng)


def majority(convs: Sequence[Conversation]) -> dict[str, float]:
    """Accuracy of always giving each kind's most frequent answer (a baseline that, unlike
    :func:`chance`, exploits unbalanced answers)."""
    answers: dict[str, list[str]] = {}
    for conv in convs:
        for kind, turn in zip(conv.meta["kinds"], conv.turns):
            answers.setdefault(kind, []).append(turn.answer)
    return {k: max(v.count(a) for a in set(v)) / len(v) for k, v in answers.items()}


def chance(convs: Sequence[Conversation]) -> dict[str, float]:
    """Expected accuracy of guessing uniformly among each question's possible answers."""
    totals: dict[str, list[float]] = {}
    for conv in convs:
        for kind, options in zip(conv.meta["kinds"], conv.meta["options"]):
            totals.setdefault(kind, []).append(1.0 / options)
    return {k: sum(v) / len(v) for k, v in totals.items()}


def encode_as_text(
    conv: Conversation, tok: WordTokenizer, digits: DigitImages, per_image: int
) -> Encoded:
    """``conv`` as text only: each image written as its digit's word ``per_image`` times."""
    ids: list[int] = []
    labels: list[int] = []
    images = iter(conv.images)
    for text, is_answer in render(conv):
        while IMAGE_PLACEHOLDER in text:
            word = WORDS[digits.label(next(images))]
            text = text.replace(IMAGE_PLACEHOLDER, " ".join([word] * per_image), 1)
        piece = tok(text) + ([tok.eos_id] if is_answer else [])
        ids.extend(piece)
        labels.extend(piece if is_answer else [-100] * len(piece))
    return Encoded(conv.id, ids, labels, [])


def answer_correct(logits: torch.Tensor, labels: torch.Tensor) -> list[list[bool]]:
    """Per row, per answer (a run of labels != -100, EOS included): whether greedy decoding
    reproduces it exactly. Teacher-forced argmax equals greedy generation here: as long as
    every earlier token matches, the model sees the same prefix either way."""
    hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
    target = labels[:, 1:] != -100
    out = []
    for row in range(labels.shape[0]):
        spans: list[bool] = []
        inside = False
        for ok, t in zip(hit[row].tolist(), target[row].tolist()):
            if t and not inside:
                spans.append(True)
            if t:
                spans[-1] = spans[-1] and ok
            inside = t
        out.append(spans)
    return out
