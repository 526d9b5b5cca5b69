"""A verifier reward function in a process of its own, so one call can be stopped.

Verifiers run code (unit tests, math checkers, the model's own programs); one that hangs or
runs away on one response must not stall the run. ``VerifierProcess`` runs ``module:function``
in a child Python process and calls it once per response over JSON lines (never pickle: the
child executes untrusted code, so nothing it sends is unpickled); a call that passes
``timeout_s`` kills the child, which is started again for the next call.

    python -m rayppo.actors.verifier module:function     # the child: one JSON line in, one out
"""

from __future__ import annotations

import importlib
import json
import math
import os
import select
import subprocess
import sys
import time
from typing import Callable

STARTUP_TIMEOUT_S = 120.0  # importing the user's module (and what it imports)


def load_reward_function(spec: str) -> Callable[[str, str], float]:
    """Import ``module:function`` (a name from the user's own config, never from data); a
    ``ConfigError`` naming ``reward.function`` and what is wrong with it."""
    from rayppo.config import ConfigError

    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(f"reward.function: {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"reward.function: cannot import module {module_name!r} ({exc}); is its folder on "
                          "PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"reward.function: importing module {module_name!r} failed: {type(exc).__name__}: "
                          f"{exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward.function: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward.function: {spec!r} is not callable")
    return fn


class VerifierTimeout(TimeoutError):
    """One call ran past its deadline; the child was killed."""


class VerifierProcess:
    """``verifier(prompt, response) -> float``, each call bounded by ``timeout_s``."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    def __call__(self, prompt: str, response: str) -> float:
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "response": response}).encode() + b"\n")
        self.proc.stdin.flush()
        try:
            reply = self._read(self.timeout_s)
        except VerifierTimeout:
            self.close()
            raise
        if "error" in reply:
            raise ValueError(reply["error"])
        return float(reply["score"])

    def _start(self) -> None:
        # The child resolves imports as this process does (the user's module may sit on sys.path).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rayppo.actors.verifier", self.spec], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
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
        fn = load_reward_function(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the field
        send({"error": str(exc)})
        return
    send({"ready": True})
    for line in sys.stdin.buffer:
        call = json.loads(line)
        try:
            score = float(fn(call["prompt"], call["response"]))
            send({"score": score if math.isfinite(score) else str(score)})
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
            send({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _serve(sys.argv[1])
