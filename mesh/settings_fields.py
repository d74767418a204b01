"""One settings mechanism: dataclass fields that describe their own command-line flag.

A settings dataclass declares each field with :func:`setting`: its default, help text, unit,
flag name, choices, metavar, and whether it is a flag at all (some settings are TOML only). From
that one declaration

* :func:`add_flags` adds the argparse flags of a dataclass to a parser or group, the default
  (with its unit) shown in ``--help``;
* :func:`flag_values` reads back the flags given on the command line;
* :func:`toml_aliases` names the extra TOML keys a table may use (a flag's own name, ``broker``
  for the field ``brokers``);
* :func:`mesh.config.settings_from_args` merges dataclass default < TOML table < flag, rejects
  unknown TOML keys by file, table and key, coerces types and validates.

Precedence needs no argv inspection: every generated flag has the argparse default ``None``, so a
flag is "given" exactly when its value is not None. An explicit flag therefore beats the file even
when its value equals the default. Dataclasses defined in modules a command does not own can be
described by a ``specs`` mapping (field name -> :class:`Spec`) instead of field metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Spec", "setting", "spec_of", "add_flags", "flag_values", "toml_aliases", "flag_fields"]

_KEY = "mesh.setting"


@dataclass(frozen=True, slots=True)
class Spec:
    """How one settings field appears on the command line.

    ``flag``: the option string (default ``--`` + the name with dashes; a bool field whose
    default is True gets ``--no-NAME``). ``cli``: False for TOML-only settings. ``unit`` is
    printed after the default in ``--help``; ``default_text`` replaces the printed default
    ("off", "discovered"). ``add`` is a shared adder that defines the flag itself (e.g.
    :func:`mesh.logs.add_log_level_arg`); ``suffix`` is appended to the help text."""

    help: str = ""
    unit: str = ""
    flag: str | None = None
    cli: bool = True
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_text: str | None = None
    add: Callable[[Any], None] | None = None


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, help: str = "",
            unit: str = "", flag: str | None = None, cli: bool = True, choices: tuple[str, ...] | list[str] | None = None,
            metavar: str | None = None, default_text: str | None = None,
            add: Callable[[Any], None] | None = None) -> Any:
    """A dataclass field carrying its :class:`Spec` (``dataclasses.field(metadata=...)``)."""
    spec = Spec(help=help, unit=unit, flag=flag, cli=cli, choices=tuple(choices) if choices else None, metavar=metavar,
                default_text=default_text, add=add)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: spec})


def spec_of(f: dataclasses.Field, specs: dict[str, Spec] | None = None) -> Spec | None:
    """The :class:`Spec` of field ``f``: from ``specs`` if it names the field, else its metadata."""
    if specs and f.name in specs:
        return specs[f.name]
    return f.metadata.get(_KEY)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _fmt(v: Any) -> str:
    if v is None or v == "" or v == () or v == []:
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (tuple, list)):
        return ", ".join(map(str, v))
    return str(v)


def _base(tp: Any) -> Any:
    """``int`` for ``int | None``; the type itself otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _option(name: str, spec: Spec, default: Any) -> str:
    if spec.flag:
        return spec.flag
    return ("--no-" if default is True else "--") + name.replace("_", "-")


def help_text(f: dataclasses.Field, spec: Spec) -> str:
    """The ``--help`` line of a field: its help, then ``(default VALUE UNIT)``."""
    d = _default(f)
    shown = spec.default_text if spec.default_text is not None else ("required" if d is dataclasses.MISSING else _fmt(d))
    unit = f" {spec.unit}" if spec.unit and spec.default_text is None and shown not in ("none", "required") else ""
    text = f"{spec.help} (default {shown}{unit})" if spec.help else f"default {shown}{unit}"
    return text.replace("%", "%%")  # argparse %-formats help strings


def flag_fields(cls: type, *, only: typing.Iterable[str] | None = None, specs: dict[str, Spec] | None = None
                ) -> list[tuple[dataclasses.Field, Spec]]:
    """The fields of ``cls`` that are command-line flags (declaration order, or ``only``'s)."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if only is not None:
        unknown = [n for n in only if n not in by_name]
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}")
        chosen = [by_name[n] for n in only]
    else:
        chosen = list(by_name.values())
    out = []
    for f in chosen:
        spec = spec_of(f, specs)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no setting() metadata (help text, flag or cli=False)")
        if spec.cli:
            out.append((f, spec))
    return out


def add_flags(parser: Any, cls: type, *, only: typing.Iterable[str] | None = None, dest_prefix: str = "",
              specs: dict[str, Spec] | None = None, suffix: dict[str, str] | None = None) -> list[str]:
    """Add one flag per command-line field of ``cls`` to ``parser`` (a parser or an argument
    group); returns the field names. Every flag's argparse default is None (given = not None);
    the dataclass default and unit are in its help. ``suffix`` appends text to some fields' help."""
    hints = typing.get_type_hints(cls)
    names = []
    for f, spec in flag_fields(cls, only=only, specs=specs):
        names.append(f.name)
        if spec.add is not None:
            spec.add(parser)
            continue
        d = _default(f)
        tp = _base(hints[f.name])
        kw: dict[str, Any] = {"dest": dest_prefix + f.name, "default": None,
                              "help": help_text(f, spec) + ((suffix or {}).get(f.name, ""))}
        if spec.choices:
            kw["choices"] = list(spec.choices)
        if spec.metavar:
            kw["metavar"] = spec.metavar
        if tp is bool:
            kw["action"] = "store_false" if d is True else "store_true"
        elif typing.get_origin(tp) is tuple:
            kw["action"] = "append"
        elif tp in (int, float):
            kw["type"] = tp
        elif tp is not str:
            raise TypeError(f"{cls.__name__}.{f.name}: a {tp} setting cannot be a flag (give cli=False)")
        parser.add_argument(_option(f.name, spec, d), **kw)
    return names


def flag_values(cls: type, args: argparse.Namespace, *, dest_prefix: str = "", only: typing.Iterable[str] | None = None,
                specs: dict[str, Spec] | None = None) -> dict[str, Any]:
    """The command-line fields of ``cls`` given in ``args`` (value not None), by field name."""
    out = {}
    for f, _spec in flag_fields(cls, only=only, specs=specs):
        v = getattr(args, dest_prefix + f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def toml_aliases(cls: type, specs: dict[str, Spec] | None = None) -> dict[str, str]:
    """TOML keys that name a field by its flag (``broker`` -> ``brokers``): alias -> field name."""
    out = {}
    for f in dataclasses.fields(cls):
        spec = spec_of(f, specs)
        if spec is None or not spec.cli or spec.add is not None or not spec.flag:
            continue
        key = spec.flag.lstrip("-").replace("-", "_")
        if key != f.name and not key.startswith("no_"):
            out[key] = f.name
    return out
