"""A batch sampled by the generator fleet once, whatever leaves it meanwhile.

``sampled_shares`` fans each share of a batch out to one generator of the fleet under the
``Supervisor`` (a generator that dies or hangs is replaced and redoes its share). When a generator
leaves the fleet during the call (its replacement finds no place: its node is gone), the call runs
to its end on the others first (``SharesLostError``), their results are kept, and only the lost
shares are split again over the generators left, in proportion to their rows and one call per
generator (``spread``; a generator given two calls of one fan-out could fail them both, and a
second fault during the recovery would then meet a call of an actor already replaced). So no share is sampled twice (a multi-turn
environment steps once per turn of each kept episode), and no call is left running on a
generator behind a retry, where it would hold the retry back and make a healthy generator look
hung. A row's noise does not depend on the generator that draws it (``data/seeds.row_seeds``), so
the batch is the one an undisturbed fleet would have sampled, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rayppo.cluster.fleet import Fleet
from rayppo.cluster.supervisor import Supervisor
from rayppo.errors import GeneratorLostError, SharesLostError

S = TypeVar("S", bound=Sized)
R = TypeVar("R")


@dataclass(frozen=True)
class ShareCall(Generic[R]):
    """The call each generator makes on its share: ``method(share, *options)``."""

    method: Callable[..., R]
    """The engine's method, by reference (``GeneratorEngine.generate``, ``.evaluate``)."""
    options: tuple = ()
    """Its arguments after the share."""
    refresh: Callable[[int], None] | None = None
    """Brings replacement generator i up to date (the current weights) before it redoes a share."""


def sampled_shares(supervisor: Supervisor, fleet: Fleet, call: ShareCall[R], shares: Sequence[S],
                   resplit: Callable[[S, int], list[S]]) -> list[R]:
    """``call`` on the fleet's active generators, share k on the k-th (``shares`` were cut for the
    fleet as it is); each result, in the shares' order (a lost share's as the results of its
    pieces, ``resplit(share, parts)``, in order)."""
    pieces: dict[tuple[int, ...], S] = {(k,): share for k, share in enumerate(shares)}
    done: dict[tuple[int, ...], R] = {}
    first = True
    while pieces:
        active = list(fleet.active)
        work = ([(key, share, g) for (key, share), g in zip(pieces.items(), active)]
                if first and len(pieces) == len(active) else spread(pieces, active, resplit))
        first, todo, pieces = False, pieces, {}
        try:
            results: list[Any] = supervisor.call(fleet.group, "generators", call.method,
                                                 [(share, *call.options) for _, share, _ in work],
                                                 refresh=call.refresh, actors=[g for _, _, g in work])
        except SharesLostError as exc:
            results = exc.results[0]
            pieces = {work[pos][0]: work[pos][1] for pos in exc.lost[0]}
        except GeneratorLostError:  # lost outside the fan-out (bringing a replacement up to date): all again
            pieces = todo
            continue
        done |= {key: out for (key, _, _), out in zip(work, results) if key not in pieces}
    return [done[key] for key in sorted(done)]


def generators_per_piece(sizes: Sequence[int], generators: int) -> list[int]:
    """How many of ``generators`` take each lost piece of ``sizes[k]`` rows: in proportion to its
    size (largest remainders), at least one each, and together no more than ``generators`` while the
    pieces are no more than the generators. So each generator gets one call of the fan-out and the
    lost rows spread evenly; only more pieces than generators give one generator two (the
    supervisor then redoes all of a dead generator's calls on its replacement, ``Supervisor._redo``)."""
    if len(sizes) >= generators:
        return [1] * len(sizes)
    total, spare = sum(sizes), generators - len(sizes)
    quotas = [spare * n / total if total else 0.0 for n in sizes]
    extra = [int(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda k: (extra[k] - quotas[k], k))
    for k in by_remainder[:spare - sum(extra)]:
        extra[k] += 1
    return [1 + e for e in extra]


def spread(pieces: dict[tuple[int, ...], S], active: Sequence[int],
           resplit: Callable[[S, int], list[S]]) -> list[tuple[tuple[int, ...], S, int]]:
    """``(key, piece, generator)`` for the lost ``pieces`` cut again over the ``active`` generators:
    piece k (its rows: ``len``) into ``generators_per_piece`` parts, the parts dealt to the
    generators in turn (one call each while the pieces are no more than the generators)."""
    sizes = [len(piece) for piece in pieces.values()]  # rows
    cut = [(key + (j,), part) for (key, piece), parts in zip(pieces.items(), generators_per_piece(sizes, len(active)))
           for j, part in enumerate(resplit(piece, parts))]
    return [(key, part, active[n % len(active)]) for n, (key, part) in enumerate(cut)]
