"""What ``rayppo train`` shows in the terminal, and where everything else goes.

The terminal gets: one line per start-up phase that takes time (with the seconds since the
command started), one line per role once its actors are ready (what they hold and how long they
took), warnings of rayppo's own (each once), the progress bar, a few sample responses now and
then, and the summary. The libraries' own output goes to files under ``output.dir/logs/``:

    driver.log          this process's log records and Python warnings (Ray, DeepSpeed, ...), and
                        what the Ray cluster reports to it (a node's death, with its raylet's last lines)
    <role>-<i>.log      each actor process's stdout and stderr (vLLM, DeepSpeed, transformers)

``rayppo pairs``, which runs vLLM in its own process, writes ``logs/pairs.log`` beside its pair file:
its log records, and its process's stdout and stderr while it samples (``Console.captured``).
``--verbose`` shows everything in the terminal as well (and Ray forwards the actors' output).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

LOG_DIR = "logs"
"""Folder of the run's log files, under ``output.dir``."""

_NOISY_LOGGERS = ("ray", "deepspeed", "DeepSpeed", "transformers", "torch", "vllm", "urllib3", "filelock",
                  "matplotlib", "PIL", "wandb", "mlflow", "git")
"""Libraries whose log records belong in driver.log, not in the terminal (unless --verbose)."""


LOG_NAMES = {"generators": "generator", "reference": "reference", "reward": "reward", "teacher": "teacher",
             "learner": "learner"}
"""Role (as in the config) -> the stem of its actors' log files (``logs/generator-0.log``)."""


class _Once(logging.Filter):
    """Lets each distinct message through once (a warning repeated every iteration is shown once)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


class _TerminalHandler(logging.Handler):
    """Writes records through tqdm, so that a progress bar on screen is not broken by them."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        self.console.write(prefix + record.getMessage())


class Console:
    """The terminal of one ``rayppo`` command (a module-level instance, ``console``)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.verbose = False
        self.t0 = time.monotonic()
        self.log_dir: Path | None = None
        self.log_file: Path | None = None
        """This process's log file (``logs/driver.log``; ``logs/pairs.log``), once ``setup`` has a folder."""

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stderr

    def write(self, line: str) -> None:
        """A line above the progress bar (if one is showing)."""
        from tqdm import tqdm

        tqdm.write(line, file=self.out)

    def phase(self, text: str) -> None:
        """A start-up phase, stamped with the seconds since the command started."""
        self.write(f"[{time.monotonic() - self.t0:6.1f}s] {text}")

    def setup(self, out_dir: str | Path | None, verbose: bool, log_name: str = "driver") -> None:
        """Route log records: rayppo's warnings to the terminal (once each); everything else,
        Python warnings included, to ``logs/<log_name>.log`` under ``out_dir`` (the terminal too with
        ``verbose``)."""
        self.verbose = verbose
        root = logging.getLogger()
        for handler in list(root.handlers):
            if getattr(handler, "_rayppo", False):
                root.removeHandler(handler)
        if out_dir is not None:
            self.log_dir = Path(out_dir).resolve() / LOG_DIR
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.log_file = self.log_dir / f"{log_name}.log"
            to_file = logging.FileHandler(self.log_file, encoding="utf-8")
            to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            to_file._rayppo = True  # type: ignore[attr-defined]
            root.addHandler(to_file)
        terminal = _TerminalHandler(self)
        terminal.setLevel(logging.INFO if verbose else logging.WARNING)
        terminal.addFilter(_Once())
        if not verbose:
            terminal.addFilter(lambda record: record.name.split(".")[0] == "rayppo")
        terminal._rayppo = True  # type: ignore[attr-defined]
        root.addHandler(terminal)
        root.setLevel(logging.INFO)
        logging.captureWarnings(True)  # FutureWarnings of the libraries go to driver.log
        if not verbose:
            for name in _NOISY_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)

    @contextmanager
    def waiting(self, what: str, total: int) -> Iterator[Callable[[], None]]:
        """A transient counter (``starting 5 actors: 2/5 [00:12]``) while something slow happens;
        yields the function that counts one more done. Gone from the screen afterwards."""
        from tqdm import tqdm

        bar = tqdm(total=total, desc=what, bar_format="{desc}: {n}/{total} ready [{elapsed}]", leave=False,
                   file=self.out, disable=not self.out.isatty())
        try:
            yield bar.update
        finally:
            bar.close()

    def close(self) -> None:
        """Back to the state of a fresh process (a later run in this process sets up its own)."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if getattr(handler, "_rayppo", False):
                root.removeHandler(handler)
                handler.close()
        self.log_dir, self.log_file, self.verbose = None, None, False

    @contextmanager
    def captured(self) -> Iterator[None]:
        """Inside, this process's stdout and stderr (file descriptors 1 and 2: Python's, C++'s and
        child processes' output) go to its log file, as an actor's go to its own: for a command that
        runs a library in this process (``rayppo pairs``: vLLM's engine, whose log records, loading
        bars and C++ warnings would fill the terminal). The console's lines and the progress bar
        still reach the terminal, through a copy of fd 2 taken first. Nothing moves with
        ``--verbose``, or before ``setup`` has a folder."""
        if self.verbose or self.log_file is None:
            yield
            return
        saved = os.dup(1), os.dup(2)
        terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding=self.out.encoding or "utf-8",
                             errors="backslashreplace")
        previous, self.stream = self.stream, terminal
        redirect_output(self.log_file)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            self.stream = previous
            terminal.close()

    def actor_log(self, role: str, index: int) -> Path | None:
        """The log file of actor ``index`` of ``role`` (``generators``, ``reference``, ``reward``,
        ``learner``); None when the actors print to the terminal (``--verbose``, or no run folder)."""
        if self.verbose or self.log_dir is None:
            return None
        return self.log_dir / f"{LOG_NAMES.get(role, role)}-{index}.log"

    @staticmethod
    def user_path(path: Path) -> str:
        """``path`` as a user would type it here: relative when under the current directory."""
        try:
            return str(path.relative_to(Path.cwd()))
        except (ValueError, OSError):  # elsewhere; or no current directory (a Ray job's, once it joined)
            return str(path)

    def details(self, role: str, index: int) -> str:
        """`` (details: runs/x/logs/reward-0.log)`` for an error about that actor, or ``""``."""
        path = self.actor_log(role, index)
        return f" (details: {self.user_path(path)})" if path else ""


console = Console()
"""The process's console; ``rayppo train`` calls ``console.setup`` once the run folder is known."""


def redirect_output(path: str | Path) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C++ and child
    processes' output too) to ``path``, appended. Called first thing in an actor process."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # e.g. a node of a cluster that cannot write the driver's path: Ray keeps the logs
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
