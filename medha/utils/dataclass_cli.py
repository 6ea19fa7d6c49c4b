"""argparse flags generated from a config dataclass, so `--help` shows each field's help.

A config may group the settings of one part under a field of its own (a nested dataclass whose
field metadata names a `flag_prefix`: `SchedulerConfig.pla.wait_s`), while its flags, YAML keys
and the settings a run echoes stay flat (`--pla-wait-s`, `pla_wait_s`): `flags` lists them,
`from_flat` builds the config from flat names, `to_flat` writes it back in the same order.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import NamedTuple


def _base_type(tp):
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


class Flag(NamedTuple):
    name: str  # the flat name: the flag without dashes, the YAML key
    path: tuple[str, ...]  # attribute names from the config down to the field
    field: dataclasses.Field
    type: type


def flags(cls) -> list[Flag]:
    """Every setting of `cls`, nested groups flattened in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        prefix = f.metadata.get("flag_prefix")
        if prefix is None:
            out.append(Flag(f.name, (f.name,), f, _base_type(hints[f.name])))
            continue
        for sub in flags(hints[f.name]):
            out.append(Flag(prefix + sub.name, (f.name, *sub.path), sub.field, sub.type))
    return out


def from_flat(cls, values: Mapping[str, object]):
    """An instance of `cls` from flat setting names (those not given keep their defaults).
    Raises ValueError naming a setting `cls` does not have."""
    known = {flag.name: flag.path for flag in flags(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
    tree: dict = {}
    for name, value in values.items():
        *groups, leaf = known[name]
        node = tree
        for g in groups:
            node = node.setdefault(g, {})
        node[leaf] = value
    return _build(cls, tree)


def _build(cls, tree: dict):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in tree:
            continue
        value = tree[f.name]
        kwargs[f.name] = _build(hints[f.name], value) if "flag_prefix" in f.metadata else value
    return cls(**kwargs)


def to_flat(obj) -> dict:
    """`obj`'s settings by flat name, in `flags` order (what a run echoes in its summary)."""
    out = {}
    for flag in flags(type(obj)):
        value = obj
        for attr in flag.path:
            value = getattr(value, attr)
        out[flag.name] = value
    return out


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), title: str | None = None
) -> None:
    """One flag per setting (its metadata's "choices", if any, are the values it accepts). A
    setting whose metadata names a "group" goes to the argument group of that title, the
    others to `title` (default: the class name); groups appear in the order of their first
    setting. `skip` names flat settings to leave out."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags(cls):
        f = flag.field
        if flag.name in skip:
            continue
        name = f.metadata.get("group") or title or cls.__name__
        group = groups.get(name)
        if group is None:
            group = groups[name] = parser.add_argument_group(name)
        names = ["--" + flag.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        if flag.type is bool:
            group.add_argument(
                *names,
                dest=flag.name,
                default=f.default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            default = f.default
            shown = "" if default is None else f" (default: {default})"
            choices = f.metadata.get("choices")
            group.add_argument(
                *names,
                dest=flag.name,
                type=flag.type,
                default=default,
                choices=choices,
                metavar="{" + ",".join(choices) + "}" if choices else flag.type.__name__.upper(),
                help=help_text + shown,
            )


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of `cls` from the parsed flags (and flat-named `overrides`)."""
    values = {
        flag.name: getattr(args, flag.name) for flag in flags(cls) if hasattr(args, flag.name)
    }
    values.update(overrides)
    return from_flat(cls, values)
