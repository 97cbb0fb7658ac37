"""``params.yaml`` as the library reads it: a YAML mapping of sections, ``KEY=VALUE`` overrides on dotted keys,
and a pydantic error turned into lines that name each key and what it allows. The torchrun entry points
(``adaattn.distributed``) read the ``models`` and ``parallel`` sections with these; the pipeline validates the
whole file with the same helpers."""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from adaattn.errors import ConfigError


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or type(err).__name__}{where}"


def load_raw(path: Path) -> dict:
    """The file's sections; a missing file names the directory looked in and ``--params``."""
    if not path.is_file():
        raise ConfigError(f"{path} not found (looked in {path.resolve().parent}); pass another with --params")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return raw


def set_override(raw: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c=value`` in a raw params dict; the path must already exist (no new keys)."""
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            allowed = ", ".join(node) if isinstance(node, dict) else "(not a section)"
            where = ".".join(parts[:i]) or "params.yaml"
            raise ConfigError(f"override {dotted!r}: no key {part!r} under {where}; allowed: {allowed}")
        if i == len(parts) - 1:
            node[part] = value
        else:
            node = node[part]


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as YAML (``[512, 1024]``, ``false``, ``bf16``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like KEY=VALUE, e.g. G1-T1.gpu.seq_lens=[512,1024]")
    key, value = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: VALUE is not valid YAML ({_yaml_problem(err)})") from None


def with_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """A deep copy of ``raw`` with each ``KEY=VALUE`` applied, in order."""
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, value = parse_override(item)
        set_override(raw, key, value)
    return raw


def allowed_keys(schema: type[BaseModel], loc: tuple) -> list[str]:
    """Keys allowed at ``loc`` in ``schema`` (aliases as written in params.yaml), for error messages."""
    model: Any = schema
    parts = iter(loc)
    for part in parts:
        fields = model.model_fields
        name = next((n for n, f in fields.items() if part in (n, f.alias)), None)
        if name is None:
            return []
        ann = fields[name].annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # an optional section: its model
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)
        if typing.get_origin(ann) is dict:  # dict[str, Model]: the next part is a free key
            next(parts, None)
            ann = typing.get_args(ann)[1]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or n for n, f in model.model_fields.items()]


def format_errors(err: ValidationError, source: str, schema: type[BaseModel]) -> str:
    """One line per error: the dotted key, what went wrong, what was given (unknown keys: the allowed ones)."""
    lines = [f"{source} is invalid:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            parent = allowed_keys(schema, e["loc"][:-1])
            msg = f"unknown key; allowed keys here: {', '.join(parent)}" if parent else "unknown key"
        got = e.get("input")
        # a check across sections names its keys in the message; the input it got is the whole file
        shown = f" (got {got!r})" if not isinstance(got, dict) or len(repr(got)) <= 200 else ""
        lines.append(f"  {loc or 'params'}: {msg}{shown}")
    return "\n".join(lines)
