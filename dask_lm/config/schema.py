"""How a config section is read from a plain dict and written back: the type check against the dataclass
annotations (:func:`config_from_dict`), and the :class:`Section` mixin every section of :mod:`dask_lm.config` has.

Nothing here knows a key: the sections (:mod:`.policy`, :mod:`.generation`) declare them, with their defaults and
docstrings, and this module only reads the annotations, so a new field needs no code here."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Section", "config_from_dict", "coerce"]

_D = TypeVar("_D", bound="DataclassInstance")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (nested dicts become dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        if len(options) == 1:  # `X | None` with a value: X's own error names the inner key
            return coerce(value, options[0], key)
        errors = []
        for option in typing.get_args(tp):
            try:
                return coerce(value, option, key)
            except ValueError as e:
                errors.append(e)
        raise ValueError(f"`{key}` must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"`{key}` must be null, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value.lower() in [str(a).lower() for a in allowed]:
            return next(a for a in allowed if str(a).lower() == value.lower())
        raise ValueError(f"`{key}` must be one of {list(allowed)}, got {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"`{key}` must be a mapping of {tp.__name__} keys, got {type(value).__name__}")
        return config_from_dict(tp, value, prefix=key)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"`{key}` must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)[:1] or (Any,)  # a bare `list` holds anything
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"`{key}` must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"`{key}` must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"`{key}` must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"`{key}` must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"`{key}` must be a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {tp!r} for {key}")


def config_from_dict(cls: type[_D], data: dict[str, Any], *, prefix: str = "policy") -> _D:
    """Build dataclass ``cls`` from ``data``; errors name the dotted key (``prefix.key``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # NeMo RL spells a few keys with a leading underscore (`_v2`, `_pad_token_id`); we keep the spelling.
    aliases = {f.metadata.get("key", f.name): f.name for f in fields.values()}
    kwargs: dict[str, Any] = {}
    # a section read only by a backend dask-lm refuses keeps whatever it holds (NeMo RL's example configs carry a
    # full megatron_cfg with enabled: false); only its `enabled` is checked
    open_into: str | None = getattr(cls, "_UNKNOWN_KEYS_INTO", None)
    for key, value in data.items():
        if key not in aliases and open_into is not None:
            kwargs.setdefault(open_into, {})[key] = value
            continue
        if key not in aliases:
            close = difflib.get_close_matches(key, list(aliases), n=1)
            hint = f"; did you mean `{prefix}.{close[0]}`?" if close else ""
            raise ValueError(f"unknown config key `{prefix}.{key}`{hint} (known keys: {sorted(aliases)})")
        name = aliases[key]
        kwargs[name] = coerce(value, hints[name], f"{prefix}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"missing required config key `{prefix}.{missing[0]}`") from e
        raise


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.metadata.get("key", f.name): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    return obj


class Section:
    """Mixin: ``from_dict`` / ``to_dict`` and dict-style reads, so NeMo RL code doing ``cfg["key"]`` ports."""

    # every Section is a @dataclass, which sets this (declared only: no class attribute is created here)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return {f.metadata.get("key", f.name): _to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __getitem__(self, key: str) -> Any:
        for f in dataclasses.fields(self):
            if f.metadata.get("key", f.name) == key:
                return getattr(self, f.name)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return self.get(key, None) is not None
