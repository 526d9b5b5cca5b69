"""The user's reward function, tried before anything starts.

A reward function with a wrong signature, one that reads a column the prompt file does not have,
or one that returns ``"yes"`` would otherwise be found by the reward actor after the whole start-up
(Ray, vLLM, DeepSpeed: half a minute on the quick-start machine). ``check_reward_function`` finds
each in well under a second, in one line naming the function, the file and row, and the value:

1. its signature is bound to the first rows' columns exactly as the reward actor will call it
   (``rayppo.actors.verifier.row_arguments``), so a required parameter no column fills is named
   with the columns the rows have;
2. it is called on those rows with a placeholder response, in the verifier's own child process
   under ``reward.timeout_s`` (it runs user code: a hang or a crash there stops nothing else);
3. what it returns must be a finite number.

Imports no torch, transformers or Ray (``rayppo.plan.inputs`` runs it before they load).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from rayppo.actors.verifier import VerifierError, VerifierProcess, VerifierTimeoutError, load_reward_function
from rayppo.config.schema import ConfigError
from rayppo.data.prompts import PromptRows
from rayppo.usercode.imports import row_arguments

ROWS_TRIED = 2
"""How many of the prompt file's first rows the function is called on."""
PLACEHOLDER_RESPONSE = ""
"""The response it is called with: the one any policy can produce (EOS first), so a function that
cannot take it would also fail mid-run."""


def check_reward_function(spec: str, rows: PromptRows, timeout_s: float) -> None:
    """Raise a ``ConfigError`` naming ``reward.function`` when ``spec`` cannot score ``rows``."""
    fn = load_reward_function(spec)
    tried = range(min(ROWS_TRIED, len(rows.prompts)))
    for i in tried:
        _check_binds("reward.function", spec, fn, rows, i, (PLACEHOLDER_RESPONSE,))
    verifier = VerifierProcess(spec, timeout_s)
    try:
        for i in tried:
            value = _call(verifier, spec, rows, i, timeout_s)
            if not math.isfinite(value):
                raise ConfigError(f"reward.function: {spec} returned {value} on {_where(rows, i)} with a placeholder "
                                  "empty response: a reward must be a finite number")
    finally:
        verifier.close()


def _where(rows: PromptRows, i: int) -> str:
    return f"{rows.source} row {i + 1}"


def _prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A plain prompt as it is; a conversation by its last message (the template renders it later)."""
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))


def _messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation a reward function gets as ``messages``: None for a plain prompt."""
    return None if isinstance(prompt, str) else prompt


def _check_binds(field: str, spec: str, fn: Callable[..., Any], rows: PromptRows, i: int, after_prompt: tuple) -> None:
    """``fn`` accepts the arguments rayppo passes for row ``i`` (the prompt, ``after_prompt``, then
    the row's columns it names), or the error says which parameter no column fills."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: only calling it can tell
        return
    prompt = rows.prompts[i]
    kwargs = row_arguments(fn, 1 + len(after_prompt))(rows.fields[i], _messages(prompt))
    try:
        signature.bind(_prompt_text(prompt), *after_prompt, **kwargs)
    except TypeError as exc:
        columns = ", ".join(sorted(rows.fields[i])) or "none besides the prompt"
        form = "fn(prompt, response" if after_prompt else "Class(prompt"
        raise ConfigError(f"{field}: {spec}{signature} cannot be called on {_where(rows, i)}: {exc} (rayppo "
                          f"calls it as {form}, **the row's columns it names), plus messages= for a "
                          f"conversation; the row's other columns: {columns})") from None


def check_environment(spec: str, rows: PromptRows, timeout_s: float) -> None:
    """Raise a ``ConfigError`` naming ``rollout.environment`` when ``spec`` cannot be imported, is
    not a class with ``step``, or cannot start an episode from the first rows (started in the
    environment's own child process, bounded by ``timeout_s``)."""
    from rayppo.episodes.environment import EnvironmentPool, Episode, load_environment

    cls = load_environment(spec)
    tried = range(min(ROWS_TRIED, len(rows.prompts)))
    for i in tried:
        _check_binds("rollout.environment", spec, cls, rows, i, ())
    pool = EnvironmentPool(spec, 1, timeout_s)
    try:
        pool.start([Episode(i, _prompt_text(rows.prompts[i]), rows.fields[i], _messages(rows.prompts[i])) for i in tried])
    except Exception as exc:  # noqa: BLE001 - the user's class failed: named, with the row
        raise ConfigError(f"rollout.environment: {exc}") from None
    finally:
        pool.close()


def _call(verifier: VerifierProcess, spec: str, rows: PromptRows, i: int, timeout_s: float) -> float:
    prompt = rows.prompts[i]
    try:
        return verifier(_prompt_text(prompt), PLACEHOLDER_RESPONSE, rows.fields[i], _messages(prompt))
    except VerifierTimeoutError:
        raise ConfigError(f"reward.function: {spec} did not answer within reward.timeout_s={timeout_s:g} s on "
                          f"{_where(rows, i)} with a placeholder empty response") from None
    except VerifierError as exc:
        raise ConfigError(f"reward.function: {spec} failed on {_where(rows, i)} (prompt {_prompt_text(prompt)!r}, "
                          f"a placeholder empty response): {exc}") from None
    except (ImportError, RuntimeError) as exc:  # the child could not import it, or died
        raise ConfigError(f"reward.function: {spec} in its child process: {exc}") from None
