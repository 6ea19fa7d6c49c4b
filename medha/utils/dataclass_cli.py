"""argparse flags generated from a config dataclass, so `--help` shows each field's help."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def _base_type(tp):
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), title: str | None = None
) -> None:
    """One flag per field (its metadata's "choices", if any, are the values it accepts). A
    field whose metadata names a "group" goes to the argument group of
    that title, the others to `title` (default: the class name); groups appear in the order of
    their first field."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        name = f.metadata.get("group") or title or cls.__name__
        group = groups.get(name)
        if group is None:
            group = groups[name] = parser.add_argument_group(name)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        tp = _base_type(hints[f.name])
        if tp is bool:
            group.add_argument(
                *flags,
                dest=f.name,
                default=f.default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            default = f.default
            shown = "" if default is None else f" (default: {default})"
            choices = f.metadata.get("choices")
            group.add_argument(
                *flags,
                dest=f.name,
                type=tp,
                default=default,
                choices=choices,
                metavar="{" + ",".join(choices) + "}" if choices else tp.__name__.upper(),
                help=help_text + shown,
            )


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(args, n) for n in names if hasattr(args, n)}
    values.update(overrides)
    return cls(**values)
