"""Every DeepSpeed JSON config in a DeepSpeedExamples checkout, through slipstream's loader.

For each ``.json`` file that is a DeepSpeed config (a top-level object with DeepSpeed's
keys), reads it the way ``slipstream.initialize`` does (``read_config``, "auto" resolved from
a stand-in model and the optimizer defaults; the batch arithmetic, which needs the world
size, is left out) and sorts it:

- **honoured**: it parses and every key given lands in the typed config;
- **refused**: a ``ConfigError`` (the reason is printed);
- **silently dropped**: it parses but some key given is in neither the typed config nor a
  warning, nor a disabled block (``"enabled": false``, nothing to act on). This must stay 0.

Keys dropped with a warning (DeepSpeed ignores them too) and disabled blocks are listed.

    python benchmarks/deepspeed_examples_configs.py /path/to/DeepSpeedExamples [--exclude compression_training,sparse_attention]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from slipstream.config import ConfigError
from slipstream.config.auto import AutoContext
from slipstream.config.loader import _apply_aliases, read_config
from slipstream.config.schema import NOT_YET_IMPLEMENTED

_DS_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "optimizer",
    "fp16",
    "bf16",
}


_ON_WHEN_PRESENT = {"sparse_attention"}  # DeepSpeed has no "enabled" switch for it


def _is_deepspeed_config(obj: Any) -> bool:
    return isinstance(obj, dict) and len(_DS_KEYS.intersection(obj)) >= 1


def _leaves(obj: Any, prefix: str = "") -> list[str]:
    if isinstance(obj, dict) and obj:
        return [p for k, v in obj.items() for p in _leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def _has(obj: Any, path: str) -> bool:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return False
        obj = obj[part]
    return True


def _switched_on(block: Any, key: str = "") -> bool:
    """Whether DeepSpeed acts on a block: it (or a block nested in it) has ``"enabled":
    true``, or it is one DeepSpeed turns on by being present (``sparse_attention``)."""
    if key in _ON_WHEN_PRESENT and block:
        return True
    if isinstance(block, dict):
        return block.get("enabled") is True or any(_switched_on(v) for v in block.values())
    return False


def _context() -> AutoContext:
    import torch

    from slipstream.optim import optimizer_defaults

    return AutoContext(
        hidden_size=1024, model_dtype=torch.float32, optimizer_defaults=optimizer_defaults
    )


def classify(raw: dict[str, Any]) -> tuple[str, str, list[str], list[str]]:
    """(verdict, reason, keys dropped with a warning or disabled, keys silently dropped)."""
    ctx = _context()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = read_config(copy.deepcopy(raw), auto=ctx)
        except ConfigError as err:
            return "refused", str(err).splitlines()[0][:160], [], []
    mapped = copy.deepcopy(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _apply_aliases(mapped)
    dumped = cfg.model_dump(exclude_unset=True, by_alias=False)
    warned = " ".join(str(w.message) for w in caught)
    noted, silent = [], []
    for path in _leaves(mapped):
        top = path.split(".")[0]
        if _has(dumped, path) or (top in dumped and not isinstance(dumped[top], dict)):
            continue
        if top in NOT_YET_IMPLEMENTED and not _switched_on(mapped[top], top):
            noted.append(f"{path} (disabled block)")
        elif path in ctx.defaulted or path.split(".")[-1] in {
            k.split(".")[-1] for k in ctx.defaulted
        }:
            noted.append(f'{path} ("auto": DeepSpeed\'s default, logged)')
        elif f"'{top}'" in warned or f"'{path}'" in warned:
            noted.append(f"{path} (warned)")
        else:
            silent.append(path)
    return ("silently dropped" if silent else "honoured"), "", noted, silent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path)
    ap.add_argument(
        "--exclude", default="", help="comma-separated top-level blocks whose configs to skip"
    )
    args = ap.parse_args(argv)
    skip = {b for b in args.exclude.split(",") if b}
    counts: dict[str, int] = {}
    excluded = 0
    for path in sorted(args.checkout.rglob("*.json")):
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if not _is_deepspeed_config(raw):
            continue
        if skip.intersection(raw):
            excluded += 1
            continue
        verdict, reason, noted, silent = classify(raw)
        counts[verdict] = counts.get(verdict, 0) + 1
        rel = path.relative_to(args.checkout)
        extra = f" {reason}" if reason else ""
        extra += f" silently dropped: {silent}" if silent else ""
        extra += f" (noted: {noted})" if noted else ""
        print(f"{verdict:17s} {rel}{extra}")
    total = sum(counts.values())
    print(f"\n{total} configs ({excluded} excluded by --exclude): {counts}")
    return 1 if counts.get("silently dropped") else 0


if __name__ == "__main__":
    sys.exit(main())
