"""Error type and message helpers shared by every typed config in slipstream."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "did_you_mean", "json_type", "type_error_message", "unknown_key_message"]


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


# pydantic error type -> what the key expects, in JSON words.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object ({...})",
    "model_type": "an object ({...})",
}


def json_type(value: object) -> str:
    """The JSON name of ``value``'s type, with an article ("a string", "an integer")."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fractional part" if not value.is_integer() else "a number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _fix(value: object, expected: str) -> str:
    """A hint for the common slips: a quoted number or boolean, 1/0 for a switch."""
    if isinstance(value, str):
        text = value.strip().lower()
        if expected == "true or false" and text in ("true", "false", "yes", "no", "on", "off"):
            return "; write true or false without quotes"
        try:
            float(text)
        except ValueError:
            return ""
        return "; write the number without quotes" if expected != "a string" else ""
    if isinstance(value, bool) and expected in ("an integer", "a number"):
        return "; true/false is not a number"
    if isinstance(value, int | float) and expected == "true or false":
        return "; write true or false, not a number"
    if isinstance(value, float) and value.is_integer() and expected == "an integer":
        return f"; write {int(value)}, without a decimal point or exponent"
    return ""


def type_error_message(path: str, value: object, error_type: str) -> str | None:
    """The message for a value of the wrong JSON type, or None for other errors.

    Names the dotted key, the value, the expected type and what was given, e.g.
    ``config key 'zero_optimization.stage' = '2': expected an integer, got a string; write
    the number without quotes``.
    """
    expected = _EXPECTED.get(error_type)
    if expected is None:
        return None
    message = f"config key '{path}' = {value!r}: expected {expected}, got {json_type(value)}"
    fix = _fix(value, expected)
    return message + (f"{fix} (slipstream does not convert config types)" if fix else "")
