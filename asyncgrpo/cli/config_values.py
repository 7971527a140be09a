"""The values of a config file against the fields' type hints: what `asyncgrpo train` checks before
a config class sees them, so that a wrong type is refused naming the key (docs/front-door.md)."""

from __future__ import annotations

import types
import typing
from typing import Any

from asyncgrpo.errors import ConfigurationError


def expect(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind):
        raise ConfigurationError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def float_from_text(value: str, name: str) -> Any:
    try:
        return float(value)
    except ValueError:
        return value  # reported as a type error by the caller


def accepts(hint: Any, kind: type) -> bool:
    return any(option is kind for option in hint_options(hint))


def hint_options(hint: Any) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def matches(value: Any, hint: Any) -> bool:
    for option in hint_options(hint):
        origin = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return True
        if option is Any:
            return True
        if option is bool:
            if isinstance(value, bool):
                return True
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif origin is typing.Literal:
            if value in typing.get_args(option):
                return True
        elif isinstance(origin, type):
            if issubclass(origin, str) and isinstance(value, str):  # str-valued enums accept their names
                return True
            if isinstance(value, origin):
                return True
        else:
            return True  # a hint this check cannot read: AsyncGRPOConfig's own checks decide
    return False


def type_name(hint: Any) -> str:
    return " or ".join(getattr(option, "__name__", str(option)) for option in hint_options(hint))
