"""The proxy-versus-gold stop rule (``stop.gold_patience``, docs/reward-models.md).

A learned reward model r_φ is a proxy: optimised long enough the policy finds responses it
over-rates, and the proxy keeps rising while the truth (a gold scorer) stalls or falls (Gao,
Schulman and Hilton 2022, arXiv:2210.10760). The rule reads the held-out evaluations of a run
(``eval/reward/mean``: the proxy, ``eval/gold/mean``: the gold) and says stop once gold has not
bettered its best for ``patience`` evaluations while the proxy rose over them.
"""

from __future__ import annotations


def gold_plateau(records: list[dict[str, float]], patience: int) -> str | None:
    """Why to stop, in one line, or None. ``records``: a run's metrics in order; only those with
    both evaluation figures count."""
    evals = [(r["eval/reward/mean"], r["eval/gold/mean"], int(r["iteration"])) for r in records
             if "eval/gold/mean" in r and "eval/reward/mean" in r]
    if patience < 1 or len(evals) <= patience:
        return None
    before, window = evals[:-patience], evals[-patience:]
    best = max(gold for _, gold, _ in before)
    proxy_from, proxy_to = before[-1][0], window[-1][0]
    if max(gold for _, gold, _ in window) > best or proxy_to <= proxy_from:
        return None
    at = next(it for _, gold, it in before if gold == best)
    return (f"the gold score has not improved on its best ({best:.3f}, iteration {at}) for {patience} evaluations "
            f"while the proxy reward rose from {proxy_from:.3f} to {proxy_to:.3f} (stop.gold_patience={patience}): "
            "the policy is over-optimising the reward model")
