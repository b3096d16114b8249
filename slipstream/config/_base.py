"""Strict pydantic base model: unknown keys and bad values become ``ConfigError``.

Types are strict, the same way for every key: no string-to-number, number-to-bool or
bool-to-number conversion (DeepSpeed's JSON has real booleans and numbers, so a quoted
``"2"`` or a ``1`` for a switch is a mistake worth naming). Two conversions remain because
JSON has a single number type: an integer is accepted where a float is expected (``"lr": 1``),
and an integral float where an element or byte count is expected, the keys a model lists in
``e_notation`` (``"reduce_bucket_size": 5e8``, as DeepSpeed's own configs write them). Any
other integer key refuses a float, integral or not (``"stage": 2.0``).
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from slipstream.config._errors import ConfigError, type_error_message, unknown_key_message

__all__ = ["StrictModel", "check_keys", "validate_model"]


def _union_args(annotation: Any) -> tuple[Any, ...]:
    """The members of ``X | Y`` (or ``(annotation,)`` when it is not a union)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _wants_int(annotation: Any) -> bool:
    args = _union_args(annotation)
    return int in args and float not in args


def _bool_literal(annotation: Any) -> bool:
    """``Literal[False]``-style fields: Python's ``0 == False`` would let 0 through."""
    return typing.get_origin(annotation) is typing.Literal and all(
        isinstance(a, bool) for a in typing.get_args(annotation)
    )


class StrictModel(BaseModel):
    """Base of every typed config: extra keys forbidden, strict types (see the module
    docstring), values validated on assignment."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, strict=True
    )
    e_notation: ClassVar[frozenset[str]] = frozenset()
    """Integer fields (element or byte counts) that accept an integral float such as 5e8."""

    @field_validator("*", mode="before")
    @classmethod
    def _json_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Integral floats become ints for the ``e_notation`` integer fields; booleans-only
        literals get bools."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if (
            isinstance(value, float)
            and value.is_integer()
            and info.field_name in cls.e_notation
            and _wants_int(field.annotation)
        ):
            return int(value)
        if _bool_literal(field.annotation) and not isinstance(value, bool):
            raise PydanticCustomError("bool_type", "Input should be a valid boolean")
        return value


def _nested_model(annotation: Any) -> type[StrictModel] | None:
    """The StrictModel class inside ``annotation`` (unwrapping ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _nested_model(arg)
            if found is not None:
                return found
    return None


def _accepted_names(model_cls: type[StrictModel]) -> dict[str, str]:
    """Map every accepted input key (field name and alias) to its field name."""
    names: dict[str, str] = {}
    for name, field in model_cls.model_fields.items():
        names[name] = name
        if field.alias:
            names[field.alias] = name
    return names


def check_keys(data: Any, model_cls: type[StrictModel], where: str) -> None:
    """Raise ``ConfigError`` with a did-you-mean for any key ``model_cls`` does not define.

    Recurses into nested StrictModel fields so the message carries the full dotted path.
    """
    if not isinstance(data, dict):
        return
    accepted = _accepted_names(model_cls)
    for key, value in data.items():
        if key not in accepted:
            raise ConfigError(unknown_key_message(key, where, accepted))
        nested = _nested_model(model_cls.model_fields[accepted[key]].annotation)
        if nested is not None:
            check_keys(value, nested, f"{where}.{key}" if where else key)


def validate_model(model_cls: type[StrictModel], data: Any, where: str) -> Any:
    """Validate ``data`` into ``model_cls``; turn pydantic errors into one ``ConfigError``."""
    check_keys(data, model_cls, where)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            raised = err.get("ctx", {}).get("error")
            if isinstance(raised, ConfigError):  # a validator's own message names its key
                lines.append(str(raised))
                continue
            loc = ".".join(str(p) for p in err["loc"])
            path = f"{where}.{loc}" if where and loc else (where or loc)
            value = err.get("input")
            typed = type_error_message(path, value, err["type"])
            lines.append(typed or f"config key '{path}' = {value!r}: {err['msg']}")
        raise ConfigError("; ".join(lines)) from None
