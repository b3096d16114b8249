"""Interleaved image-text conversations: the JSON-lines format, DeepSpeed-VisualChat's prompt
template, encoding to ids and answer-only labels, data blending, and batching.

One conversation per line::

    {"id": "c17", "turns": [
        {"images": ["img/a.png", "img/b.png"], "question": "Which ...?", "answer": "image 2"},
        {"images": [], "question": "And ...?", "answer": "..."}]}

A turn's images come just before its question; they are numbered through the conversation
when the prompt is rendered (the released template, sec. 4.2 of the spec)::

    <system instruction>
    ### Image 1:
    <image>
    ### Image 2:
    <image>
    ### Question:
    <question>
    ### Answer:
    <answer>

Because numbers come from positions, concatenating conversations renumbers their images
(``### Image 1:`` of the second becomes ``### Image n+1:``), which is the released code's
"simple concatenation" blending (:func:`concatenate`). :func:`blend` mixes sources by ratio.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "IMAGE_PLACEHOLDER",
    "SYSTEM_PROMPT",
    "Conversation",
    "Encoded",
    "Turn",
    "blend",
    "collate",
    "concatenate",
    "encode",
    "load_jsonl",
    "render",
]

IMAGE_PLACEHOLDER = "<image>"
SYSTEM_PROMPT = "### System instruction: You are a helpful language and vision assistant ."
MAX_IMAGES = 8  # the released recipe's limit per sample


@dataclass(frozen=True)
class Turn:
    """One question/answer round; ``images`` (references) are shown before the question."""

    question: str
    answer: str
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Conversation:
    """A multi-round, multi-image conversation. ``meta`` carries anything else (for example
    the kind of each question, for per-kind accuracy)."""

    id: str
    turns: tuple[Turn, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def images(self) -> list[Any]:
        """All image references, in the order they appear."""
        return [im for turn in self.turns for im in turn.images]


def _turn(raw: Any, where: str) -> Turn:
    if not isinstance(raw, dict) or not {"question", "answer"} <= raw.keys():
        raise ValueError(f"{where}: a turn needs 'question' and 'answer' (and optional 'images')")
    images = raw.get("images", [])
    if not isinstance(images, list):
        raise ValueError(f"{where}: 'images' must be a list of image references, got {images!r}")
    return Turn(str(raw["question"]), str(raw["answer"]), tuple(images))


def load_jsonl(path: str | Path) -> list[Conversation]:
    """Read conversations from a JSON-lines file (module doc). Relative image paths are
    resolved against the file's folder.

    Raises:
        ValueError: a malformed line (the message names the file, line and field).
    """
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err})") from err
        if not isinstance(raw, dict) or not isinstance(raw.get("turns"), list) or not raw["turns"]:
            raise ValueError(f"{where}: a conversation needs a non-empty 'turns' list")
        turns = tuple(_turn(t, f"{where} turn {i}") for i, t in enumerate(raw["turns"]))
        turns = tuple(
            Turn(t.question, t.answer, tuple(_resolve(im, path.parent) for im in t.images))
            for t in turns
        )
        meta = {k: v for k, v in raw.items() if k not in ("id", "turns")}
        out.append(Conversation(str(raw.get("id", f"{path.name}:{n}")), turns, meta))
    return out


def _resolve(ref: Any, base: Path) -> Any:
    if isinstance(ref, str) and not Path(ref).is_absolute() and ":" not in ref:
        return str(base / ref)
    return ref


def render(conv: Conversation, system: str = SYSTEM_PROMPT) -> list[tuple[str, bool]]:
    """The prompt as ``(text, is_answer)`` pieces, images numbered 1..n (module doc)."""
    pieces: list[tuple[str, bool]] = [(system, False)]
    number = 0
    for turn in conv.turns:
        for _ in turn.images:
            number += 1
            pieces.append((f"### Image {number}:\n{IMAGE_PLACEHOLDER}", False))
        pieces.append((f"### Question:\n{turn.question}\n### Answer:", False))
        pieces.append((turn.answer, True))
    return pieces


@dataclass
class Encoded:
    """A conversation as token ids, labels (-100 except on answers) and its images."""

    id: str
    input_ids: list[int]
    labels: list[int]
    images: list[Any]


def encode(
    conv: Conversation,
    tokenize: Callable[[str], list[int]],
    image_token_id: int,
    eos_token_id: int,
    system: str = SYSTEM_PROMPT,
) -> Encoded:
    """Token ids and answer-only labels of ``conv`` (each answer ends with ``eos``).

    Raises:
        ValueError: the text holds a different number of ``<image>`` placeholders than the
            conversation has images, or more than 8 images (names the conversation).
    """
    images = conv.images
    if len(images) > MAX_IMAGES:
        raise ValueError(
            f"conversation {conv.id!r} has {len(images)} images; at most {MAX_IMAGES} per "
            "sample (split it into several conversations)"
        )
    ids: list[int] = []
    labels: list[int] = []
    for text, is_answer in render(conv, system):
        chunks = text.split(IMAGE_PLACEHOLDER)
        piece: list[int] = []
        for i, chunk in enumerate(chunks):
            if i:
                piece.append(image_token_id)
            piece.extend(tokenize(chunk) if chunk.strip() else [])
        if is_answer:
            piece.append(eos_token_id)
        ids.extend(piece)
        labels.extend(piece if is_answer else [-100] * len(piece))
    found = ids.count(image_token_id)
    if found != len(images):
        raise ValueError(
            f"conversation {conv.id!r} has {found} <image> placeholders in its text but "
            f"{len(images)} images; leave '<image>' out of questions and answers (the template "
            "places one per image) or list the missing images"
        )
    return Encoded(conv.id, ids, labels, images)


def concatenate(
    samples: Sequence[Conversation], max_group: int, rng: random.Random
) -> list[Conversation]:
    """The released "simple concatenation": shuffle, then merge runs of 1..``max_group``
    conversations (size uniform) into one; images keep their order and are renumbered by
    :func:`render`. ``meta`` lists become the merged lists."""
    if max_group < 1:
        raise ValueError(f"concatenate: max_group={max_group} must be >= 1")
    order = list(samples)
    rng.shuffle(order)
    out: list[Conversation] = []
    i = 0
    while i < len(order):
        group = order[i : i + rng.randint(1, max_group)]
        i += len(group)
        meta: dict[str, Any] = {}
        for conv in group:
            for key, value in conv.meta.items():
                meta.setdefault(key, []).extend(value if isinstance(value, list) else [value])
        turns = tuple(t for conv in group for t in conv.turns)
        out.append(Conversation("+".join(c.id for c in group), turns, meta))
    return out


def blend(
    sources: dict[str, Sequence[Conversation]],
    ratios: dict[str, float],
    num_samples: int,
    rng: random.Random,
) -> list[Conversation]:
    """``num_samples`` conversations drawn from ``sources`` with probabilities proportional
    to ``ratios`` (each source sampled without replacement until exhausted, then again)."""
    unknown = sorted(set(ratios) - set(sources))
    if unknown or any(r < 0 for r in ratios.values()) or sum(ratios.values()) <= 0:
        raise ValueError(
            f"blend: ratios {ratios} must be >= 0, not all 0, over the sources "
            f"{sorted(sources)} (unknown: {unknown})"
        )
    names = [n for n in ratios if ratios[n] > 0 and sources[n]]
    pools: dict[str, list[Conversation]] = {n: [] for n in names}
    out = []
    for _ in range(num_samples):
        name = rng.choices(names, weights=[ratios[n] for n in names])[0]
        if not pools[name]:
            pools[name] = list(sources[name])
            rng.shuffle(pools[name])
        out.append(pools[name].pop())
    return out


def _load(
    e: Encoded, load_image: Callable[[Any], torch.Tensor], shape: tuple[int, ...] | None
) -> list[torch.Tensor]:
    out = []
    for ref in e.images:
        image = load_image(ref)
        if shape is not None and tuple(image.shape) != shape:
            raise ValueError(
                f"conversation {e.id!r}: image {ref!r} has shape {tuple(image.shape)}, the "
                f"vision encoder takes {shape} (channels, height, width); resize or convert it"
            )
        out.append(image)
    return out


def collate(
    batch: Sequence[Encoded],
    load_image: Callable[[Any], torch.Tensor],
    pad_token_id: int = 0,
    image_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Right-pad encoded conversations into the keyword arguments of ``VisualChat.forward``;
    ``image_shape`` (C, H, W) checks every image, naming the conversation of a wrong one."""
    longest = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    images = [im for e in batch for im in _load(e, load_image, image_shape)]
    return {
        "input_ids": ids,
        "images": torch.stack(images) if images else torch.zeros(0),
        "image_counts": torch.tensor([len(e.images) for e in batch]),
        "labels": labels,
        "attention_mask": mask,
        "sample_ids": [e.id for e in batch],
    }
