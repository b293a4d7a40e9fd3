"""The job's config file (``--config job.toml`` or ``.json``): read, its keys and its values'
types checked against the sections' dataclasses (elastic_train/config.py), each problem in one
line naming the key and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_train.errors import ConfigError

__all__ = ["check_file_types", "read_config_file"]


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown(kind: str, key: str, known: Sequence[str], fix: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown {kind} {key!r}{hint}: {fix}; known: {', '.join(known)}")


def read_config_file(path: Path, sections: Mapping[str, type]) -> dict[str, Any]:
    """Parse a TOML or JSON config file into the nested layout (``sections``: each table's
    dataclass, whose fields are its known keys); no validation of values."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass --config with a .toml or .json")
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = tomllib.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"config file {path} cannot be parsed ({exc}): fix its syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, not {type(data)}")
    top_known = ["run_dir", *sections]
    for key, value in data.items():
        if key not in top_known:
            raise _unknown("config key", key, top_known, f"remove it from {path}")
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: [{key}] must be a table")
            known = _field_names(sections[key])
            for sub in value:
                if sub not in known:
                    raise _unknown(f"config key in [{key}]", sub, known, f"remove it from {path}")
    return data


_FILE_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "int | None": (int, type(None)), "float | None": (int, float, type(None)),
    "str | None": (str, type(None)),
    "Mapping[str, OptionValue]": (dict,),
}


def check_file_types(section: str, cls: type, values: Mapping[str, Any]) -> None:
    """Refuse a value of the file's table ``section`` (dataclass ``cls``) whose type is not
    its field's, naming both."""
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key == "task_options" and isinstance(value, dict):
            for name, option in value.items():
                if not isinstance(option, (str, int, float, bool)):
                    raise ConfigError(f"[{section}] task_options.{name} = {option!r} is "
                                      "invalid: expected a string, number or boolean")
        allowed = _FILE_TYPES[str(hints[key])]
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise ConfigError(f"[{section}] {key} = {value!r} is invalid: expected {hints[key]}")
