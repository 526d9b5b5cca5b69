"""User code in a child Python process, one JSON line per call, each call bounded by a deadline.

The reward function (``verifier.py``) and the multi-turn environment (``rayppo/episodes``) run the
user's code here: one that hangs is killed at its deadline and started again for the next call,
one that crashes is named, and neither can stall or take down the actor that called it. Nothing
the child sends is unpickled (it runs untrusted code): the protocol is JSON lines on its stdin and
stdout, and the child's own prints go to its stderr (the actor's log).

A child module serves with ``serve(handler_factory)``: the factory imports the user's code (its
failure is the first reply, ``{"error": ...}``), then every line in is one ``handler(call)`` out.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

STARTUP_TIMEOUT_S = 120.0  # importing the user's module (and what it imports)


class ChildTimeoutError(TimeoutError):
    """One call ran past its deadline; the child was killed."""


class ChildExitedError(RuntimeError):
    """The child process ended (it crashed, or its code called exit) in the middle of a call."""


class ChildProcess:
    """``python -m module *args`` in the current directory, answering one JSON object per call."""

    def __init__(self, module: str, args: list[str]):
        self.module, self.args = module, args
        self.directory = os.getcwd()  # where the user's module is looked up first, as in this process
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``message``, return the child's reply within ``timeout_s`` (``ChildTimeoutError``: the child
        was killed; ``ChildExitedError``: it died). The child is started on first use."""
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._reap()
            raise ChildExitedError(f"the {self.module} process had exited") from None
        try:
            return self._read(timeout_s)
        except ChildTimeoutError:
            self.close()
            raise

    def _start(self) -> None:
        # The child resolves imports as this process does: the current directory first (the
        # user's module), then this process's sys.path.
        path = [self.directory, *(p for p in sys.path if p and p != self.directory)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        # A session (and process group) of its own: what the user's code starts (a code interpreter,
        # a shell) is in it, so killing the group on a timeout leaves no tool process behind.
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], env=env, cwd=self.directory,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        self._buffer = b""
        try:
            ready = self._read(STARTUP_TIMEOUT_S)
        except ChildTimeoutError:
            self.close()  # a late "ready" would be read as the next call's answer
            raise
        if "error" in ready:
            self.close()
            raise ImportError(ready["error"])

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """One JSON line from the child within ``timeout_s``."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise ChildTimeoutError(f"no answer within {timeout_s:g} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                code = self._reap()
                raise ChildExitedError(f"the {self.module} process exited with code {code}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _reap(self) -> int | None:
        code = self.proc.wait() if self.proc is not None else None
        self._kill_group()  # what it started may outlive it
        self.proc = None
        return code

    def close(self) -> None:
        if self.proc is not None:
            self._kill_group()
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _kill_group(self) -> None:
        """SIGKILL to the child's whole process group (its own session: ``_start``)."""
        assert self.proc is not None  # called only while a child is held (_reap, close)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is empty already
            pass


def _die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies (a SIGKILLed actor
    leaves no child behind, even one hung inside the user's code). Elsewhere a no-op: the child
    still ends when its stdin closes, unless it hangs."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(make_handler: Callable[[], Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """The child's side: build the handler (importing the user's code), then answer each line."""
    _die_with_parent()
    # The protocol gets its own copy of stdout; file descriptor 1 then points at stderr, so the
    # user's prints, and any process the user's code starts, write to the log, not into the protocol.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    try:
        handler = make_handler()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the field
        send({"error": str(exc)})
        return
    send({"ready": True})
    for line in sys.stdin.buffer:
        try:
            send(handler(json.loads(line)))
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
            send({"error": f"{type(exc).__name__}: {exc}"})
