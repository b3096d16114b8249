"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base DeepSpeed's
config classes (and code that extends DeepSpeed's config, such as inference plugins) derive
from, and the small helpers beside it.

A ``DeepSpeedConfigModel`` forbids unknown keys, validates defaults and assignments, accepts a
field by its name or its alias, drops values of ``"auto"`` (left for an integration such as
the Hugging Face Trainer to fill), and handles deprecated fields declared with
``Field(..., json_schema_extra={"deprecated": True, "new_param": "x", "new_param_fn": f})``:
setting the old field logs a warning and sets ``x`` to ``f(old value)``; setting both the old
and the new field is an error. slipstream's own typed config (``slipstream.config``) is
stricter still (no type coercion); this class behaves as DeepSpeed's does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any

from pydantic import BaseModel, ConfigDict

from slipstream._logging import logger

__all__ = [
    "DeepSpeedConfigModel",
    "DeprecatedFieldConflict",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]


class DeprecatedFieldConflict(AssertionError, ValueError):
    """A deprecated field and the field replacing it were both given (DeepSpeed raises an
    ``AssertionError`` here; this is also a ``ValueError``)."""


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed-style config classes (see the module docstring)."""

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if v != "auto" or k == "replace_method"}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._apply_deprecated(name, extra)

    def _apply_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        if name not in self.model_fields_set:
            return
        new_field = str(extra.get("new_param", "") or "")
        note = str(extra.get("deprecated_msg", "") or "")
        logger.warning(
            "Config parameter %s is deprecated%s%s",
            name,
            f" use {new_field} instead" if new_field else "",
            f". {note}" if note else "",
        )
        if not new_field or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn") or (lambda x: x)  # type: ignore[assignment]
        value = convert(getattr(self, name))
        *path, leaf = new_field.split(".")
        owner: Any = reduce(getattr, path, self)
        if leaf in owner.model_fields_set:
            raise DeprecatedFieldConflict(
                f"Cannot provide deprecated parameter '{name}' and replacing parameter "
                f"'{new_field}' together"
            )
        delattr(self, name)  # the replaced field leaves the model, as in DeepSpeed
        setattr(owner, leaf, value)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of ``field_name`` of a config class.

    Raises:
        ValueError: no such field, or the field is required.
    """
    fields = config.model_fields
    if field_name not in fields:
        raise ValueError(f"'{field_name}' is not a field in {config}")
    if fields[field_name].is_required():
        raise ValueError(f"'{field_name}' is a required field and has no default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):
    """An int printed with thousands separators, or with ``custom_print_str``."""

    custom_print_str: str | None

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> pp_int:
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.load`` ``object_pairs_hook`` that refuses a key given twice.

    Raises:
        ValueError: naming the duplicated keys.
    """
    out = dict(ordered_pairs)
    if len(out) != len(ordered_pairs):
        seen: set[str] = set()
        dups = sorted({k for k, _ in ordered_pairs if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        raise ValueError(f"Duplicate keys in DeepSpeed config: {dups}")
    return out
