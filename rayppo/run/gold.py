"""The proxy-versus-gold stop rule (``stop.gold_patience``, docs/reward-models.md).

A learned reward model r_φ is a proxy: optimised long enough the policy finds responses it
over-rates, and the proxy keeps rising while the truth (a gold scorer) stalls or falls (Gao,
Schulman and Hilton 2022, arXiv:2210.10760). The rule reads the held-out evaluations of a run
(the proxy's mean, ``eval/reward/mean``, and the gold's, ``eval/gold/mean``) and says stop once
gold has not bettered its best for ``patience`` evaluations while the proxy rose over them.

The run loop feeds it each evaluation as it is made (``GoldWatch``); only a resumed run reads
the evaluations before it back from its metrics records, once (``GoldWatch.of_records``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GoldPoint:
    """One held-out evaluation as the rule sees it."""

    iteration: int
    """The iteration it followed (0-based)."""
    proxy: float
    """The mean reward of the held-out responses (``eval/reward/mean``)."""
    gold: float
    """The gold scorer's mean on the same responses (``eval/gold/mean``)."""


def plateau(points: list[GoldPoint], patience: int) -> str | None:
    """Why to stop, in one line, or None. ``points``: a run's evaluations in order."""
    if patience < 1 or len(points) <= patience:
        return None
    before, window = points[:-patience], points[-patience:]
    best = max(p.gold for p in before)
    proxy_from, proxy_to = before[-1].proxy, window[-1].proxy
    if max(p.gold for p in window) > best or proxy_to <= proxy_from:
        return None
    at = next(p.iteration for p in before if p.gold == best)
    return (f"the gold score has not improved on its best ({best:.3f}, iteration {at}) for {patience} evaluations "
            f"while the proxy reward rose from {proxy_from:.3f} to {proxy_to:.3f} (stop.gold_patience={patience}): "
            "the policy is over-optimising the reward model")


def points_of(records: list[dict[str, float]]) -> list[GoldPoint]:
    """The evaluations among a run's metrics records (those with both evaluation figures)."""
    return [GoldPoint(int(r["iteration"]), r["eval/reward/mean"], r["eval/gold/mean"]) for r in records
            if "eval/gold/mean" in r and "eval/reward/mean" in r]


class GoldWatch:
    """The rule over the evaluations of a run as they come (``evaluated``); ``rewind`` forgets
    those of iterations a learner restart redoes, as the metrics file does."""

    def __init__(self, patience: int, points: list[GoldPoint] | None = None) -> None:
        self.patience = patience
        self.points: list[GoldPoint] = list(points or [])

    @classmethod
    def of_records(cls, patience: int, records: list[dict[str, float]]) -> GoldWatch:
        """The watch of a resumed run, from the metrics records it goes on from."""
        return cls(patience, points_of(records))

    def evaluated(self, iteration: int, proxy: float | None, gold: float | None) -> None:
        """The evaluation after ``iteration``: counted when it has both means."""
        if proxy is not None and gold is not None:
            self.points.append(GoldPoint(iteration, proxy, gold))

    def rewind(self, iteration: int) -> None:
        """Go on from ``iteration``: the evaluations after later iterations are dropped."""
        self.points = [p for p in self.points if p.iteration < iteration]

    def verdict(self) -> str | None:
        """Why to stop now (``plateau``), or None."""
        return plateau(self.points, self.patience)
