"""Typed drafter options: each method declares its ``speculative_config`` keys once, as a frozen
dataclass whose fields carry type, default, bounds and help (``option``); ``parse_options`` turns a
config dict into it, with one clear error naming the first bad or unknown key."""

from __future__ import annotations

import dataclasses
import os
import types
import typing


def option(default, help: str, *, choices: tuple | None = None, lo=None, hi=None, expect: str | None = None):
    """A dataclass field of an options class: ``choices`` for strings, ``lo``..``hi`` for numbers,
    ``expect`` the wording of a union's allowed values in errors."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "expect": expect}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _types(annotation) -> tuple:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(type(None) if a is None else a for a in typing.get_args(annotation))
    return (annotation,)


def _fits(value, kinds: tuple, meta: dict) -> bool:
    if value is None:
        return type(None) in kinds
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and (int in kinds or float in kinds):
        return _in_range(value, meta)
    if isinstance(value, float) and float in kinds:
        return _in_range(value, meta)
    if isinstance(value, os.PathLike) and str in kinds:  # a path where a path's string goes
        return True
    if isinstance(value, str) and str in kinds:
        return meta["choices"] is None or value in meta["choices"]
    return isinstance(value, (list, tuple)) and list in kinds


def _in_range(v, meta: dict) -> bool:
    return (meta["lo"] is None or v >= meta["lo"]) and (meta["hi"] is None or v <= meta["hi"])


def _expectation(kinds: tuple, meta: dict) -> str:
    if meta["expect"]:
        return meta["expect"]
    if meta["choices"]:
        return "one of " + ", ".join(map(repr, meta["choices"]))
    if bool in kinds:
        return "true or false"
    bounds = (f" in {meta['lo']}..{meta['hi']}" if meta["lo"] is not None and meta["hi"] is not None
              else f" >= {meta['lo']}" if meta["lo"] is not None else "")
    what = "an int" if int in kinds else "a number"
    return what + bounds + (" or None" if type(None) in kinds else "")


def parse_options(cls, values: dict, method: str):
    """``values`` (a ``speculative_config``'s keys for ``method``) -> an instance of the options class
    ``cls``. Raises ``ValueError`` naming an unknown key or a value out of its field's type or bounds."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"speculative_config for {method!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
                         f"it takes {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        kinds, meta = _types(hints[name]), fields[name].metadata
        if not _fits(value, kinds, meta):
            raise ValueError(f"{name} must be {_expectation(kinds, meta)}, got {value!r}")
    return cls(**values)

