"""The user's code named in the config (``module:name``), imported and bound to a prompt row.

A reward function (``reward.function``) and an environment class (``rollout.environment``) are
both named by the user's config, never by data, imported with the current directory first, and
called with the prompt row's columns that their signature names. Imports nothing of rayppo's
but the config's error type.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any


def import_object(spec: str, field: str, form: str) -> Any:
    """``module:name`` of the config's ``field`` imported; a ``ConfigError`` naming the field.

    The module is looked up in the current directory first, as ``python -m`` does: run through
    its console script, rayppo's ``sys.path[0]`` is the virtual environment's ``bin`` folder, and
    a ``my_rewards.py`` next to the user's config would otherwise not be found.
    """
    from rayppo.config.schema import ConfigError

    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(f"{field}: {spec!r}: expected {form}")
    cwd = os.getcwd()
    if not sys.path or sys.path[0] != cwd:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # the module may have been written since the last import
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({exc}); is it in the current "
                          "directory or on PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"{field}: importing module {module_name!r} failed: {type(exc).__name__}: "
                          f"{exc}") from None
    found = getattr(module, attr, None)
    if found is None:
        raise ConfigError(f"{field}: module {module_name!r} has no {attr!r}")
    return found


RowCall = Callable[[str, str, dict[str, Any], list | None], float]
"""``call(prompt, response, fields, messages)``: a verifier bound to a prompt row's columns."""


def row_caller(fn: Callable[..., float]) -> RowCall:
    """``fn`` called as ``fn(prompt, response, **row)``: with the row's fields that it names as
    parameters (all of them when it takes ``**kwargs``), and ``messages`` (the conversation, None
    for a plain prompt) when it names a ``messages`` parameter. A ``(prompt, response)`` function
    gets neither. A field named like the first two parameters, or ``messages``, is not passed."""
    arguments = row_arguments(fn)

    def call(prompt: str, response: str, fields: dict[str, Any], messages: list | None) -> float:
        return fn(prompt, response, **arguments(fields, messages))

    return call


def row_arguments(fn: Callable[..., Any], leading: int = 2) -> Callable[[dict[str, Any], list | None], dict[str, Any]]:
    """``arguments(fields, messages)``: the keyword arguments ``row_caller`` passes ``fn`` for a row
    after its ``leading`` positional ones (prompt, response; an environment class takes the prompt)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature (some builtins): two arguments only
        params = []
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params[leading:] if p.kind in by_name}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    reserved = {p.name for p in params[:leading]} | {"messages"}

    def arguments(fields: dict[str, Any], messages: list | None) -> dict[str, Any]:
        kwargs = {key: value for key, value in fields.items() if key not in reserved and (takes_all or key in named)}
        if "messages" in named:
            kwargs["messages"] = messages
        return kwargs

    return arguments


def number(value: Any) -> float:
    """A reward function's return value as a float; ``TypeError`` saying what it returned when that
    is not a number (a string that parses as one, ``"0.5"``, is a bug too: it is refused)."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number") from None
