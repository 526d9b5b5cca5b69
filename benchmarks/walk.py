"""The walk of one rollout from the generator to the loss: how many times the code changes rooms.

    python benchmarks/walk.py [--out walk.json] [section.field=value ...]

Issue 48's measure of how far apart the code that handles one rollout lives. A *room* is a module
(one ``.py`` file) of the ``rayppo`` package. The walk is the sequence of Python function calls
whose code lives in ``rayppo``, in the order they start (``sys.setprofile`` "call" events, also in
threads started meanwhile; C functions, and code generated at run time such as a dataclass's
``__init__``, are not calls into a room; resuming a generator is not a call, starting one is):

- it starts when the generator engine receives the rollout's tokens: the return of the backend's
  ``sample`` into ``GeneratorEngine.generate`` (vLLM and transformers alike; its room,
  ``actors/generator.py``, is the first stop);
- it ends at the first call of the PPO policy loss (``learner/ppo.py``: ``policy_loss`` or
  ``decoupled_policy_loss``), its last stop.

A *stop* is a run of consecutive calls in one room (calls that stay in a room collapse into one
stop); a *return* is a stop in a room the walk has already stopped in before (it went back into
a room it had left); *rooms* is the number of distinct modules. Two counts are printed:

- ``every call``: every call as it happens (a loop over rows that calls into another room makes
  one stop per pass: it depends on the batch size);
- ``first calls``: each (calling function, called function) pair once, at its first time: the
  walk of a reader who opens each call once. It does not depend on the batch's size (2 and 4
  prompts, 4 and 8 tokens give the same walk). The headline figures are these.

The run is the distributed trainer's (``DistributedTrainer.iteration``, the synchronous trainer a
real job runs, on the embedded default model, ``load_config(None, overrides)``) with one
generator, one reference, one reward actor and one learner rank, all *in this process*
(``ActorGroup(local=True)``, ``LearnerGroup(placement=None)``: one DeepSpeed rank on gloo), so
that one trace sees every role; nothing of Ray is started (the session, placement groups,
readiness wait and placement report are replaced by no-ops). Every value that crosses an actor
call (its arguments and its result) goes through ``pickle`` as Ray would send it (the rollout as
Arrow, ``Rollout.__reduce__``); ``--no-pickle`` leaves that out. The generator runs the
transformers backend (``generators.backend=hf``): the walk starts when ``sample`` returns, so the
backend's inside is not part of it; vLLM in this process is not tried. The weight sync and its
check come after the loss and need Ray: this iteration skips them. What a real job walks and this
does not: Ray's code (not rayppo's), the Ray branches of ``ActorGroup``, ``Supervisor`` and
``LearnerGroup`` (their local branches run instead, in the same rooms). One iteration of 2 prompts
x 4 new tokens, 1 epoch of 1 minibatch (``rollout.batch_size=2 rollout.max_new_tokens=4
ppo.epochs=1 ppo.minibatches=1``); ``section.field=value`` arguments override these. About 30 s
on 2 cores, most of it building the roles.

Prints one JSON object: for each count the calls, stops, returns (and by room), rooms and the
sequence of rooms; ``--out`` writes the same with every call of the walk (room, function, caller).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


class Walk:
    """The profile function: the calls into ``root``'s modules between ``start`` and ``end``.

    ``start(frame)`` is asked on every "return" event until it answers a frame, the first room's
    (where the returning frame's value arrives); ``end`` holds the code objects whose first call
    ends the walk (that call included)."""

    def __init__(self, root: Path, start: Any, end: set[Any]):
        self.root = str(root.resolve()) + os.sep
        self.start, self.end = start, end
        self.armed = self.done = False
        self.calls: list[dict[str, Any]] = []  # room, function, and the calling function's key
        self._started: dict[int, Any] = {}  # generator frames already started (kept alive: ids stay unique)
        self.threads: set[int] = set()

    def room(self, code: Any) -> str | None:
        path = code.co_filename
        return path[len(self.root):].replace(os.sep, "/") if path.startswith(self.root) else None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.done:
            return
        if not self.armed:
            into = self.start(frame) if event == "return" else None
            if into is not None:
                caller = into.f_code
                self.armed = True
                self.calls.append({"room": self.room(caller), "function": caller.co_qualname, "caller": None})
            return
        if event != "call":
            return
        code = frame.f_code
        room = self.room(code)
        if room is None:
            return
        if code.co_flags & _GENERATOR_FLAGS:
            if id(frame) in self._started:
                return  # a generator resumed, not called
            self._started[id(frame)] = frame
        back = frame.f_back
        caller = f"{back.f_code.co_filename}:{back.f_code.co_firstlineno}:{back.f_code.co_qualname}" if back else None
        self.calls.append({"room": room, "function": f"{code.co_qualname}:{code.co_firstlineno}", "caller": caller})
        self.threads.add(threading.get_ident())
        if code in self.end:
            self.done = True


def stops(rooms: list[str]) -> dict[str, Any]:
    """Consecutive equal rooms collapsed: the stops, how many go back into a room left before,
    the distinct rooms, and the sequence."""
    seq = [r for i, r in enumerate(rooms) if i == 0 or r != rooms[i - 1]]
    back = collections.Counter(r for i, r in enumerate(seq) if r in seq[:i])
    return {"stops": len(seq), "returns": sum(back.values()), "rooms": len(set(seq)),
            "returns_by_room": dict(back.most_common()), "sequence": seq}


def first_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (caller, callee) pair of ``calls`` once, at its first time (the first entry stays)."""
    seen: set[tuple[Any, str]] = set()
    out = []
    for c in calls:
        key = (c["caller"], c["room"] + ":" + c["function"])
        if c["caller"] is None or key not in seen:
            seen.add(key)
            out.append(c)
    return out


def in_process(pickled: bool) -> None:
    """The distributed trainer's roles built in this process, with no Ray (module docstring)."""
    import rayppo.cluster.roles as roles
    import rayppo.trainers.distributed as distributed
    from rayppo.cluster.group import ActorGroup
    from rayppo.cluster.learner_group import LearnerGroup

    def crossed(value: Any) -> Any:  # what the other process would receive
        return pickle.loads(pickle.dumps(value, protocol=5)) if pickled else value

    class LocalGroup(ActorGroup):
        def __init__(self, cls: type, args: Any, options: Any = None, local: bool = False, one_by_one: Any = None):
            super().__init__(cls, args, None, local=True)

        def call_at(self, i: int, method: Any, args: tuple) -> Any:
            return crossed(method(self.actors[i], *crossed(args)))

        def call(self, method: Any, args: Any) -> list[Any]:
            if len(args) != len(self.actors):
                raise ValueError(f"{len(args)} argument tuples for {len(self.actors)} actors")
            return [crossed(method(actor, *crossed(a))) for actor, a in zip(self.actors, args)]

    class NoPlacement:
        groups: list = []
        bundles: list = []

        def actor_options(self, i: int, env: dict[str, str] | None = None) -> dict[str, Any]:
            return {}

    class NoSession:
        def __init__(self, *args: Any, **kwargs: Any):
            pass

        def __enter__(self) -> NoSession:
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def close(self) -> None:
            pass

    class Placements(dict):
        def __missing__(self, role: str) -> NoPlacement:
            return NoPlacement()

    # The stand-ins replace classes by others of the same calls, which the type checker cannot see.
    roles_module: Any = roles
    distributed_module: Any = distributed
    roles_module.ActorGroup = LocalGroup
    roles_module.LearnerGroup = lambda cfg, placement, options=None: LearnerGroup(cfg, None)
    distributed_module.RaySession = NoSession
    distributed.reserve = lambda cfg: Placements()
    distributed.release = lambda placements: None
    distributed.wait_ready = lambda *args, **kwargs: None
    distributed.placement_report = lambda placements: {}


def walk(overrides: list[str], pickled: bool = True) -> dict[str, Any]:
    """One iteration of the in-process distributed trainer, traced; the walk's figures."""
    import rayppo
    from rayppo.actors.generator import GeneratorEngine
    from rayppo.config.load import load_config
    from rayppo.learner import ppo
    from rayppo.trainers.distributed import DistributedTrainer

    in_process(pickled)
    out_dir = tempfile.mkdtemp(prefix="rayppo-walk-")
    cfg = load_config(None, ["trainer=distributed", "generators.backend=hf", "generators.num=1", "learner.num_ranks=1",
                             "rollout.batch_size=2", "rollout.max_new_tokens=4", "ppo.epochs=1", "ppo.minibatches=1",
                             "stop.iterations=1", "checks.verify_sync=false", f"output.dir={out_dir}", *overrides])
    generate = GeneratorEngine.generate.__code__
    end = {f.__code__ for f in (getattr(ppo, "policy_loss", None), getattr(ppo, "decoupled_policy_loss", None)) if f}
    root = Path(rayppo.__file__).parent

    def tokens_arrive(frame: Any) -> Any:
        """``GeneratorEngine.generate``'s frame when ``frame`` is a backend's ``sample`` returning
        into it (through a decorator such as ``torch.no_grad``, whose frames are not rayppo's)."""
        if frame.f_code.co_name != "sample" or not frame.f_code.co_filename.startswith(str(root)):
            return None
        back = frame.f_back
        while back is not None and not back.f_code.co_filename.startswith(str(root)):
            back = back.f_back
        return back if back is not None and back.f_code is generate else None

    trace = Walk(root, tokens_arrive, end)
    trainer = DistributedTrainer(cfg)
    # The weight sync and its check come after the loss, and need Ray: the iteration ends without them
    # (the check is off in the config above; the sync sends nothing).
    trainer.weight_sync.sync = lambda version: 0
    try:
        threading.setprofile(trace)
        sys.setprofile(trace)
        try:
            trainer.iteration()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    finally:
        trainer.close()
    if not trace.done:
        raise SystemExit(f"the walk did not reach the policy loss (started: {trace.armed})")
    every, first = trace.calls, first_calls(trace.calls)
    return {
        "every_call": {"calls": len(every), **stops([c["room"] for c in every])},
        "first_calls": {"calls": len(first), **stops([c["room"] for c in first])},
        "ends_in": every[-1]["room"] + ":" + every[-1]["function"].split(":")[0],
        "threads": len(trace.threads),
        "pickled": pickled,
        "overrides": overrides,
        "calls": every,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="section.field=value config overrides")
    parser.add_argument("--out", help="write the figures and every call of the walk here (JSON)")
    parser.add_argument("--no-pickle", action="store_true", help="values cross actor calls as they are")
    args = parser.parse_args(argv)
    result = walk(args.overrides, pickled=not args.no_pickle)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    shown = {k: v for k, v in result.items() if k != "calls"}
    print(json.dumps(shown, indent=1))
    for name in ("first_calls", "every_call"):
        r = result[name]
        print(f"{name}: {r['stops']} stops, {r['returns']} returns, {r['rooms']} rooms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
