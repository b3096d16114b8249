"""DeepSpeed-Chat's preference data: ``prompt``/``chosen``/``rejected`` records, the
``data_split`` that gives each of the three steps its own share, and the per-step examples.

A record is ``{"prompt": " Human: ... Assistant:", "chosen": " ...", "rejected": " ..."}``.
DeepSpeed-Chat's local loader reads ``train.json`` and ``eval.json`` from a directory and
prepends a space to each field; :func:`load_preference_records` does the same (and also takes
one ``.json`` / ``.jsonl`` file, or a Hugging Face ``datasets`` directory written by
``save_to_disk``, whose fields are taken as they are, as DeepSpeed-Chat's HF-dataset classes
do). ``data_split="2,4,4"`` shuffles the records with a seed and
cuts them into disjoint 20% / 40% / 40% shares for steps 1 / 2 / 3 (:func:`split_for_step`).

Examples, as DeepSpeed-Chat builds them (``T`` = ``max_seq_len``):

- step 1 (:func:`sft_batch`): ``prompt + chosen + EOS`` right-padded to ``T``; labels are the
  ids with -100 on padding (the prompt is *not* masked);
- step 2 and DPO (:func:`pair_batch`): ``prompt + chosen + EOS`` and ``prompt + rejected + EOS``,
  each right-padded to ``T``, with the answer-token mask DPO sums over;
- step 3 (:func:`prompt_batch`): the prompt only, left-padded to ``max_prompt_len``, so every
  answer starts at the same index.

Truncation to ``T`` (steps 1 and 2) keeps the first ``T`` tokens, as DeepSpeed-Chat's
tokenizer call does. A prompt longer than ``max_prompt_len`` (step 3) is an error naming the
record, unless ``drop_long_prompts`` (DeepSpeed-Chat's behaviour: drop it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from slipstream.config import ConfigError

__all__ = [
    "PairBatch",
    "PreferenceRecord",
    "PromptBatch",
    "SFTBatch",
    "Tokenizer",
    "apply_chat_template",
    "check_same_tokenizer",
    "load_preference_records",
    "pair_batch",
    "parse_data_split",
    "prompt_batch",
    "sft_batch",
    "split_for_step",
    "text_batch",
]

FIELDS = ("prompt", "chosen", "rejected")


class Tokenizer(Protocol):
    """What the data path needs of a tokenizer (a Hugging Face tokenizer has it)."""

    pad_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class PreferenceRecord:
    prompt: str
    chosen: str
    rejected: str


def _records_from(
    rows: Any, source: str, leading_space: bool = True, lines: list[int] | None = None
) -> list[PreferenceRecord]:
    """``rows`` as records; ``lines``: each row's 1-based line in a ``.jsonl`` file (errors
    name the line there, else the 1-based record number)."""
    if not isinstance(rows, list):
        raise ConfigError(f"{source}: expected a JSON list of records, got {type(rows).__name__}")
    if not rows:
        raise ConfigError(f"{source} holds no records; {_SHAPE}")
    records = []
    for i, row in enumerate(rows):
        where = f"line {lines[i]}" if lines else f"record {i + 1}"
        missing = [k for k in FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ConfigError(
                f"{source}: {where} has no {', '.join(repr(k) for k in missing)} (has "
                f"{sorted(row) if isinstance(row, dict) else type(row).__name__}); every record "
                'needs "prompt", "chosen" and "rejected" strings'
            )
        bad = [k for k in FIELDS if not isinstance(row[k], str)]
        if bad:
            raise ConfigError(
                f"{source}: {where} field {bad[0]!r} is a {type(row[bad[0]]).__name__}, "
                "not a string"
            )
        # DeepSpeed-Chat's local-JSON loader prepends a space to each field.
        space = " " if leading_space else ""
        records.append(PreferenceRecord(*(space + row[k] for k in FIELDS)))
    return records


_SHAPE = (
    'a record is {"prompt": "Human: ... Assistant:", "chosen": "...", "rejected": "..."} '
    "(a .json file holds a list of them, a .jsonl file one per line)"
)


def _read_json(path: Path) -> tuple[Any, list[int] | None]:
    """The parsed file and, for ``.jsonl``, each record's 1-based line; an empty file or
    bad JSON is a ``ConfigError`` naming the file (and the line)."""
    text = path.read_text()
    if not text.strip():
        raise ConfigError(f"{path} is empty; {_SHAPE}")
    if path.suffix != ".jsonl":
        try:
            return json.loads(text), None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from e
    rows, lines = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{path}: line {n} is not valid JSON ({e.msg} at column {e.colno}); a .jsonl "
                "file holds one record per line"
            ) from e
        lines.append(n)
    return rows, lines


def load_preference_records(path: str | Path, split: str = "train") -> list[PreferenceRecord]:
    """Read preference records.

    Args:
        path: a directory holding ``{split}.json`` (DeepSpeed-Chat's local layout:
            ``train.json``, ``eval.json``) or ``{split}.jsonl``, or one ``.json``/``.jsonl``
            file of records.
        split: ``"train"`` or ``"eval"`` (directories only).

    Raises:
        ConfigError: no such file, or a record without ``prompt``/``chosen``/``rejected``.
    """
    path = Path(path)
    if _is_hf_dataset_dir(path):
        return _hf_dataset_records(path, split)
    if path.is_dir():
        candidates = [path / f"{split}.json", path / f"{split}.jsonl"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise ConfigError(
                f"preference data directory {path} has no {split}.json or {split}.jsonl; "
                'put the records (a list of {"prompt", "chosen", "rejected"}) there'
            )
        path = found[0]
    elif not path.is_file():
        raise ConfigError(f"preference data {path} does not exist")
    rows, lines = _read_json(path)
    return _records_from(rows, str(path), lines=lines)


# The files ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write.
_HF_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


def _is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)


def _hf_dataset_records(path: Path, split: str) -> list[PreferenceRecord]:
    """Records of a ``save_to_disk`` directory (a ``Dataset``, or a ``DatasetDict``'s
    ``split``); the fields are used as they are (no leading space added)."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"{path} is a Hugging Face datasets directory (save_to_disk); reading it needs the "
            "'datasets' package: pip install datasets (or export the records to train.json)"
        ) from e
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(
                f"{path}: the DatasetDict has splits {sorted(data)}, not {split!r}; save the "
                f"records under {split!r}"
            )
        data = data[split]
    return _records_from(list(data), f"{path} ({split})", leading_space=False)


def parse_data_split(data_split: str) -> list[float]:
    """``"2,4,4"`` -> ``[0.2, 0.4, 0.4]`` (three non-negative weights, not all 0)."""
    try:
        weights = [float(x) for x in data_split.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(
            f"data_split={data_split!r}: expected three non-negative weights for steps 1, 2 "
            'and 3, e.g. "2,4,4"'
        )
    total = sum(weights)
    return [w / total for w in weights]


def split_for_step(
    records: Sequence[PreferenceRecord], step: int, data_split: str = "2,4,4", seed: int = 1234
) -> list[PreferenceRecord]:
    """Step ``step``'s (1, 2 or 3) share of ``records``: a seeded shuffle cut into disjoint
    consecutive pieces by ``data_split``; the same seed gives the same pieces."""
    if step not in (1, 2, 3):
        raise ConfigError(f"step={step}: DeepSpeed-Chat has steps 1, 2 and 3")
    fractions = parse_data_split(data_split)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    bounds = [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    lo, hi = (round(b * len(records)) for b in bounds[step - 1 : step + 1])
    return [records[i] for i in order[lo:hi]]


def _special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no eos_token_id: the end-of-answer token needs one")
    return (eos if pad is None else pad), eos


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class SFTBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    """The ids with -100 on padding (the prompt is trained on, as DeepSpeed-Chat)."""


def _right_padded(rows: list[list[int]], length: int, pad: int) -> tuple[torch.Tensor, ...]:
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:length]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def sft_batch(
    tokenizer: Tokenizer, records: Sequence[PreferenceRecord], max_seq_len: int
) -> SFTBatch:
    """Step 1: ``prompt + chosen + EOS``, right-padded to ``max_seq_len``."""
    pad, eos = _special_ids(tokenizer)
    rows = [[*_encode(tokenizer, r.prompt + r.chosen), eos] for r in records]
    ids, mask = _right_padded(rows, max_seq_len, pad)
    return SFTBatch(ids, mask, ids.masked_fill(mask == 0, -100))


def text_batch(tokenizer: Tokenizer, texts: Sequence[str], max_seq_len: int) -> SFTBatch:
    """Plain text (PPO's PTX data): ``text + EOS`` right-padded to ``max_seq_len``, labels
    -100 on padding."""
    pad, eos = _special_ids(tokenizer)
    ids, mask = _right_padded([[*_encode(tokenizer, t), eos] for t in texts], max_seq_len, pad)
    return SFTBatch(ids, mask, ids.masked_fill(mask == 0, -100))


def apply_chat_template(
    tokenizer: Any, records: Sequence[PreferenceRecord]
) -> list[PreferenceRecord]:
    """Wrap each prompt in the tokenizer's chat template (one user turn and the generation
    prompt), when the tokenizer has one; answers follow as they are (the one leading space
    DeepSpeed-Chat's loader adds is dropped). Without a template, ``records`` unchanged."""
    if not getattr(tokenizer, "chat_template", None):
        return list(records)

    def wrap(prompt: str) -> str:
        turn = [{"role": "user", "content": prompt.strip()}]
        text: str = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        return text

    return [
        PreferenceRecord(wrap(r.prompt), r.chosen.removeprefix(" "), r.rejected.removeprefix(" "))
        for r in records
    ]


@dataclass(frozen=True)
class PairBatch:
    """Chosen and rejected sequences of the same prompts, each ``[B, T]`` right-padded."""

    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    chosen_answer: torch.Tensor
    """1 on the chosen answer's tokens (its EOS included), 0 on prompt and padding."""
    rejected_answer: torch.Tensor


def pair_batch(
    tokenizer: Tokenizer, records: Sequence[PreferenceRecord], max_seq_len: int
) -> PairBatch:
    """Step 2 and DPO: ``prompt + chosen + EOS`` and ``prompt + rejected + EOS`` per record."""
    pad, eos = _special_ids(tokenizer)
    out: list[torch.Tensor] = []
    for field in ("chosen", "rejected"):
        rows, answers = [], []
        for r in records:
            prompt = _encode(tokenizer, r.prompt)
            full = [*_encode(tokenizer, r.prompt + getattr(r, field)), eos]
            rows.append(full)
            answers.append([0] * len(prompt) + [1] * (len(full) - len(prompt)))
        ids, mask = _right_padded(rows, max_seq_len, pad)
        answer, _ = _right_padded(answers, max_seq_len, 0)
        out += [ids, mask, answer]
    c_ids, c_mask, c_ans, r_ids, r_mask, r_ans = out
    return PairBatch(c_ids, c_mask, r_ids, r_mask, c_ans, r_ans)


@dataclass(frozen=True)
class PromptBatch:
    input_ids: torch.Tensor
    """``[B, max_prompt_len]`` left-padded: every answer starts at index ``max_prompt_len``."""
    attention_mask: torch.Tensor


def prompt_batch(
    tokenizer: Tokenizer,
    records: Sequence[PreferenceRecord],
    max_prompt_len: int,
    drop_long_prompts: bool = False,
) -> PromptBatch:
    """Step 3: the prompts, left-padded to exactly ``max_prompt_len``.

    Raises:
        ConfigError: a prompt longer than ``max_prompt_len`` (naming the record and its
            length), unless ``drop_long_prompts`` drops it as DeepSpeed-Chat does.
    """
    pad, _ = _special_ids(tokenizer)
    rows = []
    for i, r in enumerate(records):
        encoded = _encode(tokenizer, r.prompt)
        if len(encoded) > max_prompt_len:
            if drop_long_prompts:
                continue
            raise ConfigError(
                f"prompt of record {i + 1} ({r.prompt[:40]!r}...) is {len(encoded)} tokens, "
                f"longer than max_prompt_len={max_prompt_len}; raise max_prompt_len or skip "
                "such prompts as DeepSpeed-Chat does (slipstream chat --drop-long-prompts; "
                "drop_long_prompts=True in Python)"
            )
        rows.append(encoded)
    if not rows:
        raise ConfigError(
            f"no prompt of {len(records)} fits max_prompt_len={max_prompt_len}; raise it"
            if records
            else "no prompts: the data holds no records"
        )
    ids = torch.full((len(rows), max_prompt_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        if row:
            ids[i, -len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, -len(row) :] = 1
    return PromptBatch(ids, mask)


def check_same_tokenizer(
    actor: Tokenizer,
    reward: Tokenizer,
    texts: Sequence[str],
    names: tuple[str, str] = ("actor", "reward"),
) -> None:
    """Refuse a reward model whose tokenizer differs from the actor's.

    The reward model scores the actor's token ids directly, so both must map text to the
    same ids: compares the pad and EOS ids and the encoding of each of ``texts``.

    Raises:
        ConfigError: naming what differs (the id or the first text encoded differently).
    """
    a, r = names
    for attr in ("pad_token_id", "eos_token_id"):
        if getattr(actor, attr) != getattr(reward, attr):
            raise ConfigError(
                f"the {r} tokenizer's {attr}={getattr(reward, attr)} differs from the {a}'s "
                f"({getattr(actor, attr)}): the {r} model scores the {a}'s token ids, so both "
                "need the same tokenizer"
            )
    for text in texts:
        ids_a, ids_r = _encode(actor, text), _encode(reward, text)
        if ids_a != ids_r:
            raise ConfigError(
                f"the {r} and {a} tokenizers encode {text[:40]!r} differently ({ids_r[:8]} vs "
                f"{ids_a[:8]}...): the {r} model scores the {a}'s token ids, so both need the "
                "same tokenizer (use a reward model of the actor's family)"
            )
