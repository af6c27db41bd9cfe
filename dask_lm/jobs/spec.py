"""One frozen, typed spec per batch job: each option declared once, with what it means, whether the job's manifest
pins it, and how the command line spells it.

A job's spec (:class:`~dask_lm.scoring.spec.ScoreSpec`, :class:`~dask_lm.sft.spec.SFTSpec`) is a ``kw_only``
frozen dataclass subclassing :class:`JobSpec`, whose fields are made by :func:`option`. Everything that lists a
job's options derives from those fields, so no list of them is written twice:

- :meth:`JobSpec.build`: the spec from what a Python call or the CLI gave (``None``: not given), completed on a
  resume from the manifest it resumes, then from the fields' defaults; every value is checked against the field's
  annotation by the config package's coercion (:func:`dask_lm.config.schema.coerce`), the error naming the option
  as the caller spells it (:func:`dask_lm.interface.opt`), and then by the job's own :meth:`JobSpec.check`;
- :meth:`JobSpec.manifest_options` (the manifest's ``options``, compared on resume) and
  :meth:`JobSpec.manifest_settings` (its ``settings``: recorded, not compared);
- the CLI's options (``dask_lm.cli``), whose help is the reference page of each command.

Three roles (:data:`Role`): a ``source`` is a path whose files the manifest pins by content (the inputs, the
model, a tokenizer apart from it), a ``pinned`` option changes the values written and is compared on resume, a
``setting`` changes how the job runs but no value it writes (a resume that gives one records the new value).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from dask_lm.config.schema import coerce
from dask_lm.interface import opt

__all__ = ["Role", "Option", "option", "JobSpec", "options_of", "check_columns", "precision_name", "SHORT_PRECISION"]

Role = Literal["source", "pinned", "setting"]
_PRECISIONS = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
SHORT_PRECISION = {name: short for short, name in _PRECISIONS.items()}  # what --precision takes, for messages
_META = "dask_lm.job_option"
_S = TypeVar("_S", bound="JobSpec")


@dataclasses.dataclass(frozen=True)
class Option:
    """What a job's field means to everything that is not the job itself."""

    help: str
    """The option's description: the CLI's help, and the reference docs through it."""
    role: Role
    cli: bool = True
    """Whether the command has an option for it (the inputs are its arguments instead)."""
    flag: str | None = None
    """The CLI's spelling where it is not ``--name-with-dashes``: ``--no-shuffle`` for a flag that turns a default
    ``True`` off."""
    choices: tuple[str, ...] = ()
    """The values the CLI offers (a string option)."""
    toggle: bool = False
    """A ``--name/--no-name`` pair on the CLI (a bool whose default ``None`` means "decided by the job")."""
    shown_default: str | None = None
    """What ``--help`` shows as the default, where that is not the field's default."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    role: Role = "pinned",
    cli: bool = True,
    flag: str | None = None,
    choices: tuple[str, ...] = (),
    toggle: bool = False,
    shown_default: str | None = None,
) -> Any:
    """A field of a job's spec (typed ``Any`` as :func:`dataclasses.field` is, so the annotation rules)."""
    return dataclasses.field(
        default=default,
        metadata={
            _META: Option(
                help=help, role=role, cli=cli, flag=flag, choices=choices, toggle=toggle, shown_default=shown_default
            )
        },
    )


def options_of(spec: type[JobSpec] | JobSpec) -> list[tuple[dataclasses.Field[Any], Option]]:
    """A spec's fields with their :class:`Option`, in declaration order."""
    return [(f, f.metadata[_META]) for f in dataclasses.fields(spec) if _META in f.metadata]


class JobSpec:
    """The base of a job's spec; see the module docstring. A subclass is a ``@dataclass(frozen=True,
    kw_only=True)`` whose every field is an :func:`option`."""

    JOB: ClassVar[str]
    """What an output folder of this job holds, in words ("scoring job")."""
    MODE_COLUMNS: ClassVar[tuple[str, ...]] = ()
    """The options of which exactly one way to read the rows is made: a resume that gives one of them takes none of
    the others from the manifest (a job read by ``--ids-column`` resumed with ``--text-column`` is refused naming
    both, not given both)."""

    # every JobSpec is a dataclass, which sets this (declared only)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def build(
        cls: type[_S], given: Mapping[str, Any], *, manifest: Mapping[str, Any] | None = None, manifest_path: str = ""
    ) -> _S:
        """The spec of a job: ``given`` (field -> value, ``None`` where not given), then on a resume the
        ``manifest`` read from ``manifest_path``, then the defaults. ``ValueError`` naming the option (or the
        manifest's key) for a value of the wrong type and for the job's own checks (:meth:`check`)."""
        values = cls.completed(given, manifest=manifest, manifest_path=manifest_path)
        missing = [f.name for f, _o in options_of(cls) if f.name not in values and f.default is dataclasses.MISSING]
        assert not missing, f"{cls.__name__}.build: {missing} must be given (the job's caller checks them first)"
        return cls(**values)

    @classmethod
    def completed(
        cls, given: Mapping[str, Any], *, manifest: Mapping[str, Any] | None = None, manifest_path: str = ""
    ) -> dict[str, Any]:
        """What :meth:`build` makes the spec from: ``given`` less what was not given, completed from a resume's
        ``manifest`` (the defaults are the fields' own)."""
        known = {f.name for f, _o in options_of(cls)}
        assert set(given) <= known, f"not options of {cls.__name__}: {sorted(set(given) - known)}"
        values = {k: v for k, v in given.items() if v is not None}
        if manifest is not None:
            values = {**cls._from_manifest(values, manifest, manifest_path), **values}
        return values

    @classmethod
    def given(cls, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The spec's fields among a job function's ``arguments`` (its ``locals()`` as it starts): what the call
        gave, ``None`` where it gave nothing."""
        return {f.name: arguments[f.name] for f, _o in options_of(cls)}

    @classmethod
    def _from_manifest(cls, given: Mapping[str, Any], manifest: Mapping[str, Any], path: str) -> dict[str, Any]:
        """What a resume takes from the job it resumes: the sources' paths and the options not given."""
        taken: dict[str, Any] = {}
        inputs = [e["path"] for e in manifest.get("inputs") or [] if isinstance(e, dict) and "path" in e]
        if inputs:
            taken["input"] = inputs
        if manifest.get("model") is not None:
            taken["model"] = manifest["model"]
        # the tokenizer is recorded even where it is the model's own: taken only when it was a separate one
        if manifest.get("tokenizer") is not None and manifest.get("tokenizer") != manifest.get("model"):
            taken["tokenizer"] = manifest["tokenizer"]
        recorded = {**(manifest.get("settings") or {}), **(manifest.get("options") or {})}
        mode_given = any(given.get(k) is not None for k in cls.MODE_COLUMNS)
        hints = typing.get_type_hints(cls)
        for f, o in options_of(cls):
            if o.role == "source" or f.name not in recorded or recorded[f.name] is None:
                continue
            if mode_given and f.name in cls.MODE_COLUMNS:
                continue
            value = recorded[f.name]
            try:
                _typed(value, hints[f.name], f.name)
            except ValueError:
                raise ValueError(
                    f'{path}: "{f.name}" holds {value!r}, a {type(value).__name__}, where the option '
                    f"takes {_type_words(hints[f.name])}; put back what dask-lm wrote there, or pass "
                    f"{opt('overwrite', True)} to start again"
                ) from None
            taken[f.name] = value
        return {k: v for k, v in taken.items() if k in {f.name for f, _o in options_of(cls)}}

    def __post_init__(self) -> None:
        # a spec made directly (``ScoreSpec(...)``) is checked as one built from a call or a manifest is
        hints = typing.get_type_hints(type(self))
        for f, _o in options_of(self):
            object.__setattr__(self, f.name, _typed(getattr(self, f.name), hints[f.name], f.name))
        self.check()

    def check(self) -> None:
        """The job's own checks across options (one way to read the rows, ranges); ``ValueError`` naming them. It
        may set a field to its canonical spelling (``object.__setattr__``: the spec is frozen once made)."""

    def manifest_options(self) -> dict[str, Any]:
        """The manifest's ``options``: every ``pinned`` field, compared on resume."""
        return {f.name: getattr(self, f.name) for f, o in options_of(self) if o.role == "pinned"}

    def manifest_settings(self) -> dict[str, Any]:
        """The manifest's ``settings``: every ``setting`` field, recorded but not compared."""
        return {f.name: getattr(self, f.name) for f, o in options_of(self) if o.role == "setting"}

    @classmethod
    def flags(cls) -> dict[str, str]:
        """The options whose CLI spelling a message about a difference must give whole (``shuffle (off with
        --no-shuffle)``): those spelled other than ``--name-with-dashes``."""
        return {f.name: f"{f.name} (off with {o.flag})" for f, o in options_of(cls) if o.flag is not None}


def _typed(value: Any, tp: Any, name: str) -> Any:
    """``value`` checked against the annotation ``tp`` by the config package's coercion, its error naming the
    option as the caller spells it; paths become strings, a list of inputs a tuple."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if typing.get_origin(tp) is tuple or _optional_tuple(tp):
        value = [value] if isinstance(value, (str, os.PathLike)) else value
        if isinstance(value, (list, tuple)):
            value = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
        return tuple(coerce(value, tp, opt(name)))
    return coerce(value, tp, opt(name))


def _optional_tuple(tp: Any) -> bool:
    return any(typing.get_origin(a) is tuple for a in typing.get_args(tp))


def _type_words(tp: Any) -> str:
    """An annotation in words, for a manifest's value of the wrong type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    names = {bool: "a bool", int: "an int", float: "a float", str: "a str"}
    return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args)


def check_columns(
    *,
    text_column: str | None,
    prompt_column: str | None,
    response_column: str | None,
    ids_column: str | None = None,
    takes_ids: bool = True,
) -> None:
    """Exactly one way to read the rows: a text column, token ids (jobs that ``takes_ids``), or prompt + response."""
    modes = [
        (opt("text_column"), text_column),
        (f"{opt('prompt_column')} with {opt('response_column')}", prompt_column or response_column),
    ]
    if takes_ids:
        modes.insert(1, (opt("ids_column"), ids_column))
    given = [flag for flag, on in modes if on]
    if len(given) != 1:
        flags = [flag for flag, _ in modes]
        raise ValueError(f"give exactly one of {', '.join(flags[:-1])} or {flags[-1]} (got {given or 'none'})")
    if (prompt_column is None) != (response_column is None):
        raise ValueError(f"{opt('prompt_column')} and {opt('response_column')} go together")


def precision_name(precision: str | None, allowed: tuple[str, ...] = ("bf16", "fp32", "fp16")) -> str | None:
    """The torch dtype name of ``--precision`` (``bf16`` or ``bfloat16``); ``None`` for auto, which the workers'
    devices decide once the cluster is up (:func:`worker_precision`)."""
    if precision in (None, "auto"):
        return None
    name = _PRECISIONS.get(precision, precision)
    if name not in [_PRECISIONS[a] for a in allowed]:
        raise ValueError(
            f"{opt('precision')} must be auto, {', '.join(allowed[:-1])} or {allowed[-1]}, got {precision!r}"
        )
    return name
