"""Every seed of a run, from one hash of a tuple that names its use.

A call's seed is ``derive(use, ...)``: blake2b of the tuple's ``repr`` (kind, run seed, iteration,
round, turn ...), 63 bits. Two different calls never share one unless the hash collides (2^-63 a
pair), so no call of a run repeats another's noise: not the extra rounds of dynamic sampling or
partial rollouts against the next iteration, not an evaluation against training, not a row
continued in a later call against its own earlier tokens. Arithmetic seeds (``seed * M + i``,
``seed + 1``) had exactly those collisions.

A call's seed only names the call: it is hashed again, never handed to a generator. What a
generator is handed, a row's or a minibatch plan's seed, is folded to 32 bits (``fold``): torch's
CPU generator (the transformers backend's row noise, vLLM on CPU, the minibatch plan) keeps only a
seed's low 32 bits, while vLLM's GPU sampler hashes all 64 (v1/worker/gpu/sample/gumbel.py,
``murmur3_hash32``, 0.32), so 63-bit seeds s and s + 2^32 drew the same noise on CPU only. At 32
bits every engine draws what its seeds say: two rows of different groups or calls share noise at
2^-32 a pair (the birthday count: n rows hold about n^2 / 2^33 such pairs, ~116 in a million), and
the rows of one group in a call never do (``row_seeds``).

The kinds (each function below names one):

- ``rollout``: a generator call of a training batch: (run seed, iteration, round); round 0 is the
  iteration's first call, rounds >= 1 dynamic sampling's extra calls or a partial-rollout call's
  further rounds.
- ``eval``: every evaluation (the same each time, so that sampled evaluations compare policies).
- ``turn``: turn k of a multi-turn episode within a call.
- ``row``: the base of a group's rows in a call: (call seed, group); a row's seed is the base plus
  its place in the group, so that G generators draw what one draws (docs/cluster.md, "Sampling noise").
- ``minibatch``: the minibatch plan of an iteration (every learner rank and the driver).

Standard library only: generators, learners and trainers share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SEED_BITS = 32
"""The bits of every seed a generator is handed (``fold``)."""


def derive(*use: int | str) -> int:
    """The 63-bit key of the use named by ``use`` (a kind first, then the integers that place it)."""
    digest = hashlib.blake2b(repr(use).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def fold(key: int) -> int:
    """``key`` as a generator's seed: its high bits xor'd onto its low ``SEED_BITS``, so that no
    two seeds a generator could tell apart on GPU are one seed on CPU (module docstring)."""
    return (key ^ (key >> SEED_BITS)) % 2**SEED_BITS


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
    """The 32-bit seed of ``iteration``'s minibatch plan: every rank, and the driver dealing rows to
    them, draws the same plan from it."""
    return fold(derive("minibatch", seed, iteration))


def row_seeds(call_seed: int, groups: Sequence[int]) -> list[int]:
    """Each row's 32-bit seed in a call: (call seed, the row's group, its place among that group's
    rows in the call); not the generator that samples it, nor how many generators there are.

    A group's places take consecutive seeds from one hashed base: base + place mod 2^32, distinct
    for any group size up to 2^32, so no two samples of a prompt in a call share noise (a hash per
    place would collide within a group at 2^-32 a pair). Across groups nothing is lost: two groups
    of G rows overlap with chance (2G - 1) / 2^32, sharing G^2 / 2^32 pairs on average, what G^2
    independent 32-bit seeds share (in fewer, longer overlaps).
    """
    base: dict[int, int] = {}
    seen: dict[int, int] = {}
    seeds = []
    for group in groups:
        if group not in base:
            base[group] = fold(derive("row", call_seed, group))
        place = seen[group] = seen.get(group, -1) + 1
        seeds.append((base[group] + place) % 2**SEED_BITS)
    return seeds
