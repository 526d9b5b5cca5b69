"""Actor groups: N copies of a plain engine class, as Ray actors or in this process.

Calls fan out by method *reference*, never by name string typed at a call site:

    group = ActorGroup(GeneratorEngine, [kwargs_0, kwargs_1], options)     # or tuples of positional arguments
    rollouts = group.get(group.call(GeneratorEngine.generate, [(prompts_0, seed), (prompts_1, seed)]))

``local=True`` builds the engines here with no Ray at all (tests, debugging); the same calls work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rayppo.errors import ActorFailedError, brief

E = TypeVar("E")
R = TypeVar("R")


class ActorGroup(Generic[E]):
    """``len(args)`` instances of ``cls``, actor i built from ``args[i]`` (keyword arguments, or a
    tuple of positional ones); ``options[i]`` are the Ray actor options of actor i."""

    def __init__(self, cls: type[E], args: Sequence[dict[str, Any] | tuple], options: Sequence[dict[str, Any]] | None = None,
                 local: bool = False, one_by_one: Callable[..., Any] | None = None):
        """``one_by_one=Engine.ready``: start each actor only once the previous one answers it."""
        self.local = local
        if local:
            self.actors: list[Any] = [cls(**a) if isinstance(a, dict) else cls(*a) for a in args]
            return
        self._remote, self._args = ray.remote(cls), list(args)
        self._options = [options[i] if options else {} for i in range(len(args))]
        self.actors = []
        for i in range(len(args)):
            self.actors.append(self._start(i))
            if one_by_one is not None:
                get(getattr(self.actors[-1], one_by_one.__name__).remote())

    def _start(self, i: int) -> Any:
        args, actor = self._args[i], self._remote.options(**self._options[i])
        return actor.remote(**args) if isinstance(args, dict) else actor.remote(*args)

    def add(self, args: dict[str, Any] | tuple, options: dict[str, Any]) -> int:
        """One more actor, built from ``args`` with Ray actor ``options``; returns its index."""
        if self.local:
            raise ValueError("an in-process group does not grow")
        self._args.append(args)
        self._options.append(options)
        self.actors.append(self._start(len(self.actors)))
        return len(self.actors) - 1

    def restart(self, i: int) -> None:
        """Replace actor ``i`` (dead or hung) by a new one built with the same arguments and options."""
        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone: nothing to kill
            pass
        self.actors[i] = self._start(i)

    def call_at(self, i: int, method: Callable[..., R], args: tuple) -> Any:
        """Start ``method`` on actor ``i`` alone; returns its future (its value when local)."""
        if self.local:
            return method(self.actors[i], *args)
        return getattr(self.actors[i], method.__name__).remote(*args)

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: Callable[..., R], args: Sequence[tuple]) -> list[Any]:
        """Start ``method`` on actor i with ``args[i]``; returns futures (values when local)."""
        if len(args) != len(self.actors):
            raise ValueError(f"{len(args)} argument tuples for {len(self.actors)} actors")
        if self.local:
            return [method(actor, *a) for actor, a in zip(self.actors, args)]
        return [getattr(actor, method.__name__).remote(*a) for actor, a in zip(self.actors, args)]

    def call_all(self, method: Callable[..., R], *args: Any) -> list[Any]:
        """Start ``method`` with the same arguments on every actor."""
        return self.call(method, [args] * len(self.actors))

    def get(self, futures: list[Any]) -> list[Any]:
        """Wait for ``call``'s futures; a failure in an actor is re-raised as its own exception."""
        return futures if self.local else get(futures)

    def kill(self) -> None:
        if not self.local:
            for actor in self.actors:
                ray.kill(actor)
        self.actors = []


def get(futures: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises an actor's exception as itself (its message names the problem)."""
    try:
        return ray.get(futures, timeout=timeout)
    except RayTaskError as exc:
        raise exc.as_instanceof_cause() from None


def get_within(future: Any, timeout_s: float, what: str) -> Any:
    """``get`` with a deadline, for a call outside ``Supervisor.run`` (a replacement brought up to
    date): an actor that dies or misses it raises ``ActorFailedError`` saying ``what`` did not happen."""
    try:
        return get(future, timeout=timeout_s)
    except (GetTimeoutError, RayActorError) as exc:
        raise ActorFailedError(f"{what} within cluster.call_timeout_s={timeout_s:g} s ({brief(exc)})") from None
