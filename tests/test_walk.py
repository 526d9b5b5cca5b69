"""benchmarks/walk.py counts what its docstring says, on a toy package of three rooms (the real
walk, one traced iteration of the in-process distributed trainer, is ``python benchmarks/walk.py``)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "walk.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_walk_starts_when_the_tokens_arrive_ends_at_the_loss_and_counts_stops_and_returns(tmp_path):
    walk = _load("rayppo_walk_test", SCRIPT)
    root = tmp_path / "toy"
    root.mkdir()
    (root / "gen.py").write_text(textwrap.dedent("""
        def sample():
            return helper(1)           # before the walk: not counted
        def generate(rows):
            tokens = sample()
            return [helper(r) for r in rows], tokens
        def loop(rows):
            return list(helper(r) for r in rows)
    """))
    (root / "toy_math.py").write_text(textwrap.dedent("""
        def helper(x):
            return x
        def policy_loss(x):
            return -x
        def after():
            return 0
    """))
    (root / "learn.py").write_text(textwrap.dedent("""
        def learn(rows):
            out, _ = gen.generate(rows)
            gen.loop(rows)
            loss = toy_math.policy_loss(sum(out))
            toy_math.after()           # after the loss: not counted
            return loss
    """))
    gen, learn, toy_math = (_load(f"rayppo_walk_toy_{n}", root / f"{n}.py") for n in ("gen", "learn", "toy_math"))
    learn.gen, learn.toy_math, gen.helper = gen, toy_math, toy_math.helper

    def arrive(frame):
        back = frame.f_back
        return back if frame.f_code is gen.sample.__code__ and back.f_code is gen.generate.__code__ else None

    trace = walk.Walk(root, arrive, {toy_math.policy_loss.__code__})
    sys.setprofile(trace)
    try:
        learn.learn([1, 2, 3])
    finally:
        sys.setprofile(None)

    assert trace.done
    rooms = [c["room"] for c in trace.calls]
    # generate (arrival) -> listcomp in gen -> helper x3 -> loop (gen), its genexpr started once
    # (resumptions are not calls) -> helper x3 -> policy_loss
    assert rooms == ["gen.py", "gen.py", "toy_math.py", "toy_math.py", "toy_math.py", "gen.py", "gen.py",
                     "toy_math.py", "toy_math.py", "toy_math.py", "toy_math.py"]
    assert trace.calls[-1]["function"].startswith("policy_loss")
    every = walk.stops(rooms)
    assert (every["stops"], every["returns"], every["rooms"]) == (4, 2, 2)
    assert every["sequence"] == ["gen.py", "toy_math.py", "gen.py", "toy_math.py"]
    assert every["returns_by_room"] == {"gen.py": 1, "toy_math.py": 1}
    # Each (caller, callee) pair once: the listcomp's and the genexpr's helper calls count once each.
    first = walk.first_calls(trace.calls)
    assert [c["room"] for c in first] == ["gen.py", "gen.py", "toy_math.py", "gen.py", "gen.py", "toy_math.py",
                                         "toy_math.py"]
    assert walk.stops([c["room"] for c in first])["stops"] == 4


def test_a_loop_between_two_rooms_makes_a_stop_per_pass_unless_counted_once():
    walk = _load("rayppo_walk_test", SCRIPT)
    rooms = ["a.py", "b.py", "a.py", "b.py", "a.py", "c.py"]
    assert {k: walk.stops(rooms)[k] for k in ("stops", "returns", "rooms")} == {"stops": 6, "returns": 3, "rooms": 3}
    calls = [{"room": r, "function": "f" + r, "caller": None if i == 0 else "x" + rooms[i - 1]}
             for i, r in enumerate(rooms)]
    assert [c["room"] for c in walk.first_calls(calls)] == ["a.py", "b.py", "a.py", "c.py"]
