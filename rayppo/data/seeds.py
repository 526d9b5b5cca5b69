"""Every seed of a run, from one hash of a tuple that names its use.

A seed is ``derive(use, ...)``: blake2b of the tuple's ``repr`` (kind, run seed, iteration, round,
group, place, turn ...), 63 bits. Two different uses never share a seed unless the hash collides
(2^-63 a pair), so no draw of a run repeats another's noise: not the extra rounds of dynamic
sampling or partial rollouts against the next iteration, not an evaluation against training, not a
row continued in a later call against its own earlier tokens. Arithmetic seeds (``seed * M + i``,
``seed + 1``) had exactly those collisions.

The kinds (each function below names one):

- ``rollout``: a generator call of a training batch: (run seed, iteration, round); round 0 is the
  iteration's first call, rounds >= 1 dynamic sampling's extra calls or a partial-rollout call's
  further rounds.
- ``eval``: every evaluation (the same each time, so that sampled evaluations compare policies).
- ``turn``: turn k of a multi-turn episode within a call.
- ``row``: one response of a call: (call seed, group, place in the group), so that G generators
  draw what one draws (docs/cluster.md, "Sampling noise").
- ``minibatch``: the minibatch plan of an iteration (every learner rank and the driver).

Standard library only: generators, learners and trainers share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def derive(*use: int | str) -> int:
    """The 63-bit seed of the use named by ``use`` (a kind first, then the integers that place it)."""
    digest = hashlib.blake2b(repr(use).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def rollout_seed(seed: int, iteration: int, round_: int = 0) -> int:
    """A training call's seed: round ``round_`` of ``iteration`` (0: its first call)."""
    return derive("rollout", seed, iteration, round_)


def eval_seed(seed: int) -> int:
    """Every evaluation's seed."""
    return derive("eval", seed)


def turn_seed(call_seed: int, turn: int) -> int:
    """The seed of turn ``turn`` of a call's multi-turn episodes."""
    return derive("turn", call_seed, turn)


def minibatch_seed(seed: int, iteration: int) -> int:
    """The seed of ``iteration``'s minibatch plan: every rank, and the driver dealing rows to them,
    draws the same plan from it."""
    return derive("minibatch", seed, iteration)


def row_seeds(call_seed: int, groups: Sequence[int]) -> list[int]:
    """Each row's seed in a call: (call seed, the row's group, its place among that group's rows
    in the call); not the generator that samples it, nor how many generators there are."""
    seen: dict[int, int] = {}
    seeds = []
    for group in groups:
        place = seen[group] = seen.get(group, -1) + 1
        seeds.append(derive("row", call_seed, group, place))
    return seeds
