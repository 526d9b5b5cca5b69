"""How a run is asked to stop: Ctrl-C and SIGTERM, taken between iterations when there is time."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from rayppo.console import console


class StopRequest:
    """How a run is asked to stop, between iterations when there is time, at once otherwise.

    - Ctrl-C (SIGINT): stop after the current iteration, then write a checkpoint; a second Ctrl-C
      stops at once.
    - SIGTERM, a preemption (``ray job stop``, Kubernetes eviction, spot reclaim: SIGKILL follows
      within a grace period): stop after the current iteration and write its checkpoint when that
      fits in ``grace_s`` (estimated from the last iteration's and the last checkpoint's seconds);
      otherwise, or once the grace is nearly spent, stop at once.

    Stopping at an iteration boundary keeps the interrupt out of Ray and DeepSpeed calls in flight,
    so the checkpoint that follows is consistent. A stop at once (``KeyboardInterrupt`` in the
    loop) writes no checkpoint: the learner may be half-way through its update, so the latest
    checkpoint stands.

    ``rayppo pairs`` stops the same way between its batches (``step="batch"``, ``checkpoint=False``:
    what a batch made is written when it ends, nothing is saved after it).
    """

    def __init__(self, grace_s: float = 25.0, step: str = "iteration", checkpoint: bool = True) -> None:
        self.grace_s = grace_s
        self.step, self.checkpoint = step, checkpoint
        """What a stop waits for (``iteration``, ``batch``), and whether a checkpoint follows it."""
        self.requested: str | None = None
        """``interrupted`` (Ctrl-C) or ``preempted`` (SIGTERM) once asked."""
        self.iteration_started = time.monotonic()
        self.last_iteration_s: float | None = None
        self.last_checkpoint_s: float | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._stopping = False  # the loop has ended: nothing left to cut short

    def _sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping:  # a late signal (or the grace timer) after the loop ended: nothing to stop
            return
        if self.requested:
            raise KeyboardInterrupt
        self.requested = "interrupted"
        then = ", then saving a checkpoint" if self.checkpoint else ""
        console.write(f"Ctrl-C: stopping after this {self.step}{then} (Ctrl-C again to stop now)")

    def _sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping:
            return
        asked, self.requested = self.requested, "preempted"
        if asked:  # a second signal: no more waiting
            raise KeyboardInterrupt
        checkpoint_s = 0.0 if not self.checkpoint else (
            self.last_checkpoint_s if self.last_checkpoint_s is not None else self.grace_s / 4)
        left = (self.last_iteration_s or 0.0) - (time.monotonic() - self.iteration_started)
        if max(0.0, left) + checkpoint_s > self.grace_s:
            saving = f" and its checkpoint ~{checkpoint_s:.0f} s" if self.checkpoint else ""
            console.write(f"SIGTERM: the {self.step} in flight needs ~{max(0.0, left):.0f} s more{saving}, over "
                          f"stop.sigterm_grace_s={self.grace_s:g}: stopping now")
            raise KeyboardInterrupt
        saving = " and saving its checkpoint" if self.checkpoint else ""
        console.write(f"SIGTERM: finishing this {self.step}{saving} within stop.sigterm_grace_s={self.grace_s:g} s")
        self._timer = threading.Timer(max(0.0, self.grace_s - checkpoint_s), self._grace_spent)
        self._timer.daemon = True
        self._timer.start()

    def _grace_spent(self) -> None:
        with self._lock:
            if not self._stopping:  # the iteration is still running: cut it short
                console.write(f"SIGTERM: stop.sigterm_grace_s={self.grace_s:g} s nearly spent: stopping now")
                # A real signal to the main thread: it also wakes a blocking wait there (sleep, a
                # socket, Ray's get), which _thread.interrupt_main would leave sleeping.
                main_ident = threading.main_thread().ident
                assert main_ident is not None  # the main thread is always started
                signal.pthread_kill(main_ident, signal.SIGINT)  # _sigint: KeyboardInterrupt

    def iteration_begins(self) -> None:
        """An iteration starts now (what a SIGTERM estimates the time left from)."""
        self.iteration_started = time.monotonic()

    def iteration_done(self, seconds: float) -> None:
        """The last iteration took ``seconds`` (a checkpoint's apart)."""
        self.last_iteration_s = seconds

    def stopping(self) -> None:
        """The loop has ended; a timer still pending no longer cuts anything short."""
        with self._lock:
            self._stopping = True
        if self._timer is not None:
            self._timer.cancel()

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """The handlers of SIGINT and SIGTERM inside (the main thread only), the previous ones after."""
        if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._sigint), signal.signal(signal.SIGTERM, self._sigterm)
        try:
            yield self
        finally:
            try:
                self.stopping()
            finally:
                signal.signal(signal.SIGINT, previous[0])
                signal.signal(signal.SIGTERM, previous[1])
