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

import math
import sys
from collections.abc import Callable
from typing import Any

from rayppo.usercode.child import ChildExitedError, ChildProcess, ChildTimeoutError, serve
from rayppo.usercode.imports import import_object, number, row_caller


def load_reward_function(spec: str) -> Callable[..., float]:
    """Import ``module:function`` (a name from the user's own config, never from data); a
    ``ConfigError`` naming ``reward.function`` and what is wrong with it."""
    from rayppo.config.schema import ConfigError

    fn = import_object(spec, "reward.function", "module:function")
    if not callable(fn):
        raise ConfigError(f"reward.function: {spec!r} is not callable")
    return fn


class VerifierError(ValueError):
    """The user's function raised in the child process; the message is its ``Type: message``."""


class VerifierTimeoutError(ChildTimeoutError):
    """One call ran past its deadline; the child was killed."""


class VerifierProcess:
    """``verifier(prompt, response, fields, messages) -> float``, each call bounded by
    ``timeout_s``; ``fields`` and ``messages`` reach the function as ``row_caller`` says."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.child = ChildProcess("rayppo.actors.verifier", [spec])

    def __call__(self, prompt: str, response: str, fields: dict[str, Any] | None = None,
                 messages: list | None = None) -> float:
        call = {"prompt": prompt, "response": response, "fields": fields or {}, "messages": messages}
        try:
            reply = self.child.call(call, self.timeout_s)
        except ChildTimeoutError as exc:
            raise VerifierTimeoutError(str(exc)) from None
        except ChildExitedError as exc:
            raise RuntimeError(str(exc).replace("rayppo.actors.verifier", "verifier")) from None
        if "error" in reply:
            raise VerifierError(reply["error"])
        return float(reply["score"])

    def close(self) -> None:
        self.child.close()


def _handler(spec: str) -> Callable[[dict], dict]:
    """The child's reward call: the function bound to a row, its value a finite number or its text."""
    fn = row_caller(load_reward_function(spec))

    def handle(call: dict) -> dict:
        score = number(fn(call["prompt"], call["response"], call.get("fields") or {}, call.get("messages")))
        return {"score": score if math.isfinite(score) else str(score)}

    return handle


if __name__ == "__main__":
    serve(lambda: _handler(sys.argv[1]))
