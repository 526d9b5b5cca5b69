"""A verifier reward function in a process of its own, so one call can be stopped.

Verifiers run code (unit tests, math checkers, the model's own programs); one that hangs or
runs away on one response must not stall the run. ``VerifierProcess`` runs ``module:function``
in a child Python process and calls it once per response over JSON lines (never pickle: the
child executes untrusted code, so nothing it sends is unpickled), the prompt row's other columns
and conversation included; a call that passes ``timeout_s`` kills the child, which is started
again for the next call.

    python -m rayppo.actors.verifier module:function     # the child: one JSON line in, one out
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import select
import subprocess
import sys
import time
from typing import Any, Callable

STARTUP_TIMEOUT_S = 120.0  # importing the user's module (and what it imports)


def load_reward_function(spec: str) -> Callable[..., float]:
    """Import ``module:function`` (a name from the user's own config, never from data); a
    ``ConfigError`` naming ``reward.function`` and what is wrong with it.

    The module is looked up in the current directory first, as ``python -m`` does: run through
    its console script, rayppo's ``sys.path[0]`` is the virtual environment's ``bin`` folder, and
    a ``my_rewards.py`` next to the user's config would otherwise not be found.
    """
    from rayppo.config.schema import ConfigError

    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(f"reward.function: {spec!r}: expected module:function")
    cwd = os.getcwd()
    if not sys.path or sys.path[0] != cwd:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # the module may have been written since the last import
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"reward.function: cannot import module {module_name!r} ({exc}); is it in the current "
                          "directory or on PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"reward.function: importing module {module_name!r} failed: {type(exc).__name__}: "
                          f"{exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward.function: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward.function: {spec!r} is not callable")
    return fn


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


def row_arguments(fn: Callable[..., float]) -> Callable[[dict[str, Any], list | None], dict[str, Any]]:
    """``arguments(fields, messages)``: the keyword arguments ``row_caller`` passes ``fn`` for a row."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature (some builtins): two arguments only
        params = []
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params[2:] if p.kind in by_name}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    reserved = {p.name for p in params[:2]} | {"messages"}

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


class VerifierError(ValueError):
    """The user's function raised in the child process; the message is its ``Type: message``."""


class VerifierTimeout(TimeoutError):
    """One call ran past its deadline; the child was killed."""


class VerifierProcess:
    """``verifier(prompt, response, fields, messages) -> float``, each call bounded by
    ``timeout_s``; ``fields`` and ``messages`` reach the function as ``row_caller`` says."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.directory = os.getcwd()  # where the user's module is looked up first, as in this process
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    def __call__(self, prompt: str, response: str, fields: dict[str, Any] | None = None,
                 messages: list | None = None) -> float:
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        call = {"prompt": prompt, "response": response, "fields": fields or {}, "messages": messages}
        self.proc.stdin.write(json.dumps(call).encode() + b"\n")
        self.proc.stdin.flush()
        try:
            reply = self._read(self.timeout_s)
        except VerifierTimeout:
            self.close()
            raise
        if "error" in reply:
            raise VerifierError(reply["error"])
        return float(reply["score"])

    def _start(self) -> None:
        # The child resolves imports as this process does: the current directory first (the
        # user's module), then this process's sys.path.
        path = [self.directory, *(p for p in sys.path if p and p != self.directory)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rayppo.actors.verifier", self.spec], env=env,
                                     cwd=self.directory, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""
        ready = self._read(STARTUP_TIMEOUT_S)
        if "error" in ready:
            self.close()
            raise ImportError(ready["error"])

    def _read(self, timeout_s: float) -> dict:
        """One JSON line from the child within ``timeout_s``."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise VerifierTimeout(f"no answer within {timeout_s:g} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.proc = None
                raise RuntimeError(f"the verifier process exited with code {code}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _serve(spec: str) -> None:
    """The child: import the function, then answer one JSON line per call on stdout."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the user's prints go to the log, not into the protocol

    def send(message: dict) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    try:
        fn = row_caller(load_reward_function(spec))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the field
        send({"error": str(exc)})
        return
    send({"ready": True})
    for line in sys.stdin.buffer:
        call = json.loads(line)
        try:
            score = number(fn(call["prompt"], call["response"], call.get("fields") or {}, call.get("messages")))
            send({"score": score if math.isfinite(score) else str(score)})
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
            send({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _serve(sys.argv[1])
