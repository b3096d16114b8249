"""Strict pydantic base model: unknown keys and bad values become ``ConfigError``."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from slipstream.config._errors import ConfigError, unknown_key_message

__all__ = ["StrictModel", "check_keys", "validate_model"]


class StrictModel(BaseModel):
    """Base of every typed config: extra keys forbidden, values validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


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
            loc = ".".join(str(p) for p in err["loc"])
            path = f"{where}.{loc}" if where and loc else (where or loc)
            value = err.get("input")
            lines.append(f"config key '{path}' = {value!r}: {err['msg']}")
        raise ConfigError("; ".join(lines)) from None
