"""Loading: defaults, then a YAML file, then dotted command-line overrides, then the cross-field
checks. Every error names the field it is about."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rayppo.config.checks import check_choice, validate
from rayppo.config.schema import Config, ConfigError


# ------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides into the dataclass tree
# ------------------------------------------------------------------------------------------
def _convert(value: Any, hint: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the field's annotated type, or raise naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return check_choice(value, hint, name)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], name)
    if hint is bool:
        return _to_bool(value, name)
    if hint in (int, float):
        return _to_number(value, hint, name)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    if origin in (dict, list):
        return _to_container(value, origin, name)
    return value


def _to_bool(value: Any, name: str) -> bool:
    """``true``/``false`` as YAML or a command line writes them (``yes``/``no``, ``1``/``0``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def _to_number(value: Any, hint: type, name: str) -> Any:
    """An ``int`` (a float only when whole) or a ``float``; never a bool, which Python counts as one."""
    kind = "an integer" if hint is int else "a number"
    if isinstance(value, bool) or (hint is int and isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{name}: expected {kind}, got {value!r}")
    try:
        return hint(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind}, got {value!r}") from None


def _to_container(value: Any, origin: type, name: str) -> Any:
    """A mapping for a ``dict`` field, a list for a ``list`` field, each a copy of the value given."""
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return dict(value)
    if not isinstance(value, list):
        raise ConfigError(f"{name}: expected a list, got {value!r}")
    return list(value)


def _apply(obj: Any, data: dict[str, Any], prefix: str) -> None:
    """Set the fields of dataclass ``obj`` from a (nested) mapping, rejecting unknown keys."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{name}: unknown {'section' if not prefix else 'field'} ({_suggest(str(key), names, prefix)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a mapping of fields, got {value!r}")
            _apply(current, value, f"{name}.")
        else:
            setattr(obj, key, _convert(value, hints[key], name))


def _suggest(key: str, names: set[str], prefix: str) -> str:
    """``did you mean ppo.clip_eps?`` for a near miss, else the names there are."""
    import difflib

    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"known: {', '.join(sorted(names))}"


def parse_override(text: str) -> dict[str, Any]:
    """``"ppo.clip_eps=0.1"`` -> ``{"ppo": {"clip_eps": 0.1}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like section.field=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    nested: dict[str, Any] = {}
    node = nested
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return nested


INPUT_PATHS = ("model.policy", "model.reference", "model.critic", "model.cache_dir", "data.prompts", "eval.prompts",
               "reward.model", "distill.teacher")
"""Fields naming files or folders to read. Set in a ``--config`` file, a relative one is relative
to that file's folder (the file and its data travel together); on the command line, to the
current directory. ``output.dir`` is always relative to the current directory."""


def _builtin(value: str) -> bool:
    """A built-in model or prompt set (``embedded``, ``smollm2-135m-instruct``, ``arithmetic``, ...),
    not a path."""
    from rayppo.data.prompts import EMBEDDED_PROMPTS
    from rayppo.models.paths import BUILTIN_MODELS

    return value in BUILTIN_MODELS or value in EMBEDDED_PROMPTS


def _paths_relative_to(data: dict[str, Any], folder: Path) -> None:
    """Rewrite the relative ``INPUT_PATHS`` of a YAML mapping as seen from the current
    directory (kept relative, so a submitted job's working directory still works)."""
    import os

    for name in INPUT_PATHS:
        section, key = name.split(".")
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and not _builtin(value) and not Path(value).is_absolute():
            data[section][key] = os.path.relpath(folder / value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                paths_relative_to_file: bool = True) -> Config:
    """Build the config: defaults, then the YAML file, then the dotted overrides; then validate.
    ``paths_relative_to_file=False``: the file's paths are relative to the current directory
    (a run's own saved config.yaml, written with them so)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {path} is not valid YAML{_yaml_where(exc)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections")
        if paths_relative_to_file:
            _paths_relative_to(data, path.parent)
        _apply(cfg, data, "")
    chosen: set[str] = set()
    for text in overrides or []:
        override = parse_override(text)
        chosen |= {f"{section}.{key}" for section, fields in override.items() if isinstance(fields, dict)
                   for key in fields}
        _apply(cfg, override, "")
    if path is not None and isinstance(data.get("reward"), dict):
        chosen |= {f"reward.{key}" for key in data["reward"]}
    if "reward.function" not in chosen and (cfg.reward.model or cfg.reward.url or cfg.rollout.environment):
        # Choosing a reward model, an endpoint or an environment (whose turn rewards are a reward of
        # their own) replaces the default verifier, which scores the embedded single-turn task only.
        cfg.reward.function = None
    return validate(cfg)


def _yaml_where(exc: yaml.YAMLError) -> str:
    """`` (line 3, column 1: expected ',' or ']')``: PyYAML's several-line message in one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or ""
    if mark is None:
        return f": {' '.join(str(exc).split())}"
    return f" (line {mark.line + 1}, column {mark.column + 1}: {problem})"

