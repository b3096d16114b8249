"""Error type and message helpers shared by every typed config in slipstream."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "did_you_mean", "unknown_key_message"]


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent.

    The message always names the key (dotted path), the bad value and the fix.
    Subclasses ``ValueError`` so callers that guard DeepSpeed configs with
    ``except ValueError`` keep working.
    """


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """Return the closest candidate to ``name`` (case-insensitive), or None."""
    cands = list(candidates)
    lowered = {c.lower(): c for c in cands}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def unknown_key_message(key: str, where: str, candidates: Iterable[str]) -> str:
    """Build the standard "unknown key" message with a did-you-mean suggestion."""
    cands = sorted(candidates)
    path = f"{where}.{key}" if where else key
    hint = did_you_mean(key, cands)
    msg = f"unknown config key '{path}'"
    if hint is not None:
        msg += f"; did you mean '{hint}'?"
    else:
        shown = ", ".join(cands[:12]) + (", ..." if len(cands) > 12 else "")
        msg += f"; valid keys here are: {shown}"
    return msg + " (remove or rename it: slipstream rejects keys it would otherwise ignore)"
