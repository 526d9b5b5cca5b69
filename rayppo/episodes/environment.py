"""The environment a multi-turn episode talks to (``rollout.environment = module:Class``).

The user's class, one instance per episode, built from the episode's prompt row::

    class Guess:
        def __init__(self, prompt: str, secret: int):    # the row's columns it names, like a reward function
            ...
        def step(self, action: str) -> tuple[str | None, float, bool]:
            return observation, reward, done              # observation: the next message's text

``action`` is the policy's turn as text (its sampled tokens decoded, the end-of-turn token left
out); ``observation`` is the text of the message the environment answers with (None or ignored
when ``done``); ``reward`` is the turn's reward, placed on the turn's last action token.

The class runs in child processes (``EnvironmentPool``, over ``rayppo.usercode.child``): each step
is bounded by ``rollout.environment_timeout_s``, so a tool that hangs is killed and named, one
that crashes is named, and neither stalls the generator. Each child hosts the episodes assigned
to it, and the children step at the same time.

    python -m rayppo.episodes.environment module:Class     # a child: one JSON line in, one out
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from rayppo.errors import RayppoError
from rayppo.usercode.child import ChildExitedError, ChildProcess, ChildTimeoutError, serve
from rayppo.usercode.imports import import_object, row_arguments


class EnvironmentFailedError(RayppoError, RuntimeError):
    """An environment step failed, ran past its deadline, or answered something unusable; the
    message names the environment, the episode's prompt and the turn."""


@dataclass(frozen=True)
class Step:
    """What the environment answered to one turn."""

    observation: str | None
    """The text of its next message; None when the episode is done."""
    reward: float
    """The turn's reward r_k (on the turn's last action token)."""
    done: bool
    """The episode ended (a true termination, like EOS for a single response)."""
    seconds: float = 0.0
    """How long the step took in the environment's process (the call's round trip)."""


def load_environment(spec: str) -> type:
    """Import ``module:Class`` (a name from the user's config, never from data); a ``ConfigError``
    naming ``rollout.environment`` when it cannot be imported or has no ``step`` method."""
    from rayppo.config.schema import ConfigError

    cls = import_object(spec, "rollout.environment", "module:Class")
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise ConfigError(f"rollout.environment: {spec!r} is not a class with a step(action) method")
    return cls


def check_step(value: Any) -> Step:
    """A ``step`` return value as a ``Step``; ``TypeError`` saying what is wrong with it."""
    if not (isinstance(value, tuple) and len(value) == 3):
        raise TypeError(f"step returned {value!r}; expected (observation: str | None, reward: float, done: bool)")
    observation, reward, done = value
    if not isinstance(done, bool):
        raise TypeError(f"step returned done={done!r} ({type(done).__name__}), not a bool")
    if isinstance(reward, (str, bytes, bool)) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"step returned reward={reward!r}, not a finite number")
    if not done and not isinstance(observation, str):
        raise TypeError(f"step returned observation={observation!r} for an episode that is not done; expected a str")
    return Step(observation if not done else None, float(reward), done)


def _handler(spec: str) -> Callable[[dict], dict]:
    """The child's side: episodes by id, built by ``start``, advanced by ``step``, dropped by ``end``."""
    cls = load_environment(spec)
    arguments = row_arguments(cls, leading=1)
    episodes: dict[int, Any] = {}

    def handle(call: dict) -> dict:
        op, episode = call["op"], int(call["episode"])
        if op == "start":
            episodes[episode] = cls(call["prompt"], **arguments(call.get("fields") or {}, call.get("messages")))
            return {"ok": True}
        if op == "end":
            episodes.pop(episode, None)
            return {"ok": True}
        step = check_step(episodes[episode].step(call["action"]))
        return {"observation": step.observation, "reward": step.reward, "done": step.done}

    return handle


@dataclass(frozen=True)
class Episode:
    """An episode as the pool knows it: its id and the prompt row it started from."""

    id: int
    prompt: str
    fields: dict[str, Any]
    messages: list | None


class EnvironmentPool:
    """``workers`` child processes running ``spec``; episode k lives on worker k mod ``workers``.

    ``start`` and ``step`` take many episodes at once and run them on the workers at the same
    time (each worker's episodes one after another). A call past ``timeout_s`` kills its worker:
    every episode it held is lost, so the error names the one that hung; the run's rule for it
    is the caller's (``rollout.environment_timeout_reward``)."""

    def __init__(self, spec: str, workers: int, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.workers = [ChildProcess("rayppo.episodes.environment", [spec]) for _ in range(max(1, workers))]
        self._threads = ThreadPoolExecutor(len(self.workers), thread_name_prefix="rayppo-env")
        # A worker's process count: it goes up when a failed call leaves the process dead, which
        # takes every episode it held (those that stepped before the failure in the same turn too).
        self._generation = [0] * len(self.workers)
        self._ended_on: list[str] = [""] * len(self.workers)  # the prompt whose call ended each process
        self._homes: dict[int, int] = {}  # episode id -> the generation of its worker it was started in

    def start(self, episodes: list[Episode]) -> None:
        """Build each episode's environment from its prompt row."""
        calls = [(e, {"op": "start", "episode": e.id, "prompt": e.prompt, "fields": e.fields, "messages": e.messages})
                 for e in episodes]
        self._run(calls, "starting")

    def step(self, episodes: list[Episode], actions: list[str], turn: int) -> list[Step | Exception]:
        """Each episode's answer to its action (turn ``turn``, 1-based, for the messages), or the
        ``EnvironmentFailedError`` of a step that failed, hung or answered wrongly."""
        calls = [(e, {"op": "step", "episode": e.id, "action": a}) for e, a in zip(episodes, actions)]
        return [r if isinstance(r, Exception)
                else Step(r["observation"], float(r["reward"]), bool(r["done"]), r["seconds"])
                for r in self._run(calls, f"turn {turn}", raise_first=False)]

    def end(self, episodes: list[Episode]) -> None:
        """Drop the episodes' environments (a worker that was killed has none left to drop)."""
        self._run([(e, {"op": "end", "episode": e.id}) for e in episodes], "ending", raise_first=False)

    def _run(self, calls: list[tuple[Episode, dict]], what: str, raise_first: bool = True) -> list[Any]:
        by_worker: dict[int, list[int]] = {}
        for i, (episode, _) in enumerate(calls):
            by_worker.setdefault(episode.id % len(self.workers), []).append(i)
        results: list[Any] = [None] * len(calls)

        def run_worker(w: int) -> None:
            for i in by_worker[w]:
                episode, message = calls[i]
                if message["op"] == "start":
                    self._homes[episode.id] = self._generation[w]
                elif self._homes.get(episode.id, self._generation[w]) != self._generation[w]:
                    results[i] = self._lost(episode, message["op"], what, w)
                    continue
                results[i] = self._call(self.workers[w], episode, message, what)
                if message["op"] == "end":
                    self._homes.pop(episode.id, None)
                if isinstance(results[i], Exception) and self.workers[w].proc is None:
                    self._generation[w] += 1
                    self._ended_on[w] = episode.prompt

        futures = [self._threads.submit(run_worker, w) for w in by_worker]
        wait(futures)  # every worker done before anything is raised (``end`` must not meet a busy one)
        for future in futures:
            future.result()
        errors = [r for r in results if isinstance(r, Exception)]
        if raise_first and errors:
            raise errors[0]
        return results

    def _lost(self, episode: Episode, op: str, what: str, w: int) -> dict | Exception:
        """An episode whose environment died with an earlier process of worker ``w``: nothing is
        called (an ``end`` would only start a fresh process to drop nothing); a step fails naming
        the prompt whose call ended that process, not this healthy one."""
        if op == "end":
            self._homes.pop(episode.id, None)
            return {"ok": True}
        return EnvironmentFailedError(f"environment {self.spec} ({what}) on prompt {episode.prompt!r}: lost with its "
                                  f"process, which ended on prompt {self._ended_on[w]!r}")

    def _call(self, worker: ChildProcess, episode: Episode, message: dict, what: str) -> dict | Exception:
        where = f"environment {self.spec} ({what}) on prompt {episode.prompt!r}"
        start = time.monotonic()
        try:
            reply = worker.call(message, self.timeout_s)
        except ChildTimeoutError:
            return EnvironmentFailedError(f"{where} ran past rollout.environment_timeout_s={self.timeout_s:g} s; "
                                      "its process was killed")
        except ChildExitedError as exc:
            return EnvironmentFailedError(f"{where}: {str(exc).replace('rayppo.episodes.environment', 'environment')}")
        except ImportError as exc:  # the child could not import the class
            return EnvironmentFailedError(f"{where}: {exc}")
        except Exception as exc:  # noqa: BLE001 - e.g. an answer that is not JSON: the protocol is lost
            worker.close()
            return EnvironmentFailedError(f"{where}: {type(exc).__name__}: {exc}; its process was stopped")
        if "error" in reply:
            return EnvironmentFailedError(f"{where} failed: {reply['error']}")
        return {**reply, "seconds": time.monotonic() - start}

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self._threads.shutdown(wait=False)


if __name__ == "__main__":
    serve(lambda: _handler(sys.argv[1]))
