"""Reading a run config: YAML file, then dotted command-line overrides, then validation.

`load_config(path, overrides)` is the only entry: it reads the YAML, applies overrides such as
`algo.max_staleness=0` (values parsed as YAML scalars), converts to `schema.Config` and runs the
cross-field checks (`checks.validate`). Every failure raises `ConfigError` naming the field and the fix.
Imports only msgspec and yaml (and the schema and checks beside it), so that entry points can parse
their config before heavy imports.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Any

import msgspec
import yaml

from offpolicy.config.checks import validate
from offpolicy.config.schema import Config, ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-6 as a float (YAML 1.2), not as the string PyYAML 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _yaml(text):
    return yaml.load(text, Loader=_Loader)


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML at `path` (None = defaults), apply `a.b=value` overrides, convert and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                raw = _yaml(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: pass an existing YAML file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    try:
        cfg = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(e)) from None
    validate(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.field=value` override to a raw config mapping in place."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value, e.g. algo.max_staleness=0")
    parts = key.strip().split(".")
    _check_path(parts)
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {p} is not a section")
    try:
        node[parts[-1]] = _yaml(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not a YAML scalar or list: {e}") from None


def _check_path(parts: list[str]) -> None:
    for i, p in enumerate(parts):
        parent = _field_type(parts[:i]) if i else Config
        fields = getattr(parent, "__struct_fields__", None)
        if fields is None:  # a free-form mapping such as model.arch
            return
        if p not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown field {'.'.join(parts[: i + 1])}: {where} has {', '.join(fields)}")


def _explain(e: msgspec.ValidationError) -> str:
    msg = str(e)
    text, sep, where = msg.rpartition(" - at `$.")
    field = where.rstrip("`").replace("[", ".").replace("]", "") if sep else ""
    text = text if sep else msg
    unknown = _UNKNOWN.match(text)
    if unknown:  # report it as the override path check does: the field and what the section has
        parts = [*filter(None, field.split(".")), unknown.group(1)]
        try:
            _check_path(parts)
        except ConfigError as ce:
            return str(ce)
    choices = typing.get_args(_field_type(field.split("."))) if field else ()
    if "enum value" in text and choices:
        return f"config field {field}: {text}; use one of {', '.join(map(repr, choices))}"
    if not field:
        return f"config: {text}"
    return f"config field {field}: {text}; fix the value in the YAML file or the override"


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _field_type(parts: list[str]) -> Any:
    struct: Any = Config
    for p in parts:
        fields = getattr(struct, "__struct_fields__", ())
        if p not in fields:
            return None
        struct = msgspec.structs.fields(struct)[fields.index(p)].type
    return struct
