"""Run outputs: one JSON line per iteration (also fanned out to the trackers: TensorBoard, W&B,
MLflow), a few sample completions, and a PNG of reward and KL."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rayppo.errors import RayppoError
from rayppo.run.samples import Sample
from rayppo.run.tracking import TensorBoardTracker, Tracker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)


class MetricsLogger:
    """Writes ``metrics.jsonl`` under the run folder and hands every record to ``trackers``."""

    def __init__(self, out_dir: str | Path, trackers: Sequence[Tracker] | bool = (), resume_at: int | None = None):
        """``trackers``: from ``rayppo.run.tracking.make_trackers`` (closed by ``close``). The old
        form ``MetricsLogger(dir, tensorboard: bool)`` still means a TensorBoard tracker in
        ``dir/tb`` or none, until every caller passes trackers.

        ``resume_at=k``: continue a run from iteration k. Records of iterations >= k (written
        after the checkpoint, before the run stopped) are dropped, from TensorBoard too, so
        the resumed iterations replace them instead of appearing twice."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if isinstance(trackers, bool):
            trackers = [TensorBoardTracker(self.dir / "tb")] if trackers else []
        self.trackers: list[Tracker] = list(trackers)
        self.path = self.dir / "metrics.jsonl"
        self._open(resume_at)
        if resume_at is not None:
            for tracker in self.trackers:
                tracker.rewind(resume_at)

    def _open(self, resume_at: int | None) -> None:
        if resume_at is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if r["iteration"] < resume_at]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = self.path.open("w" if resume_at is None else "a", encoding="utf-8")

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        """One line ``{"iteration": ..., **metrics}``, and the same record to every tracker. An
        evaluation with a gold scorer (``eval/gold/mean``) also sends the proxy-and-gold-against-KL
        figure, drawn from every record so far: TensorBoard's scalars can only be plotted against
        the iteration."""
        self._file.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(iteration, metrics)
        if self.trackers and "eval/gold/mean" in metrics:
            figure = gold_figure(read_metrics(self.path))
            for tracker in self.trackers:
                tracker.log_figure(iteration, GOLD_FIGURE, figure)
            figure.clf()

    def log_samples(self, iteration: int, samples: Sequence[Sample]) -> None:
        """A few completions of ``iteration`` (``pick_samples``) to every tracker."""
        for tracker in self.trackers:
            tracker.log_samples(iteration, samples)

    def rewind(self, iteration: int) -> None:
        """Continue at ``iteration``, later records dropped: after the run went back to an
        earlier checkpoint, the iterations it redoes replace the first attempt's."""
        self._file.close()
        self._open(iteration)
        for tracker in self.trackers:
            tracker.rewind(iteration)

    def close(self) -> None:
        """Close the file and every tracker (all of them, even when one fails)."""
        self._file.close()
        failure: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # the others still get to flush; the first failure is raised
                failure = failure or exc
        if failure is not None:
            raise failure


class MetricsFileError(RayppoError, ValueError):
    """A ``metrics.jsonl`` line that is not a record (other than a torn last one); names file and line."""


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file. A torn last line (the run was killed while writing
    it: no newline after it) is left out with a warning; any other bad line is an error naming it."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):
                log.warning("%s: its last line is torn (the run was killed while writing it); left out", path)
                continue
            raise MetricsFileError(f"{path}:{number}: not a JSON record: {line[:80]!r}") from None
    return records


def plot_metrics(records: list[dict[str, float]], out_png: str | Path, kl_budget: float | None = None) -> None:
    """Reward and KL(pi || pi_ref) per iteration, side by side. The reward panel shades the
    batch's min..max and mean ± std where the records have them, and adds the evaluations
    (``eval/reward/mean``, ``eval/greedy/reward/mean``) at the iterations that have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in records]
    gold = any("reward/gold_mean" in r for r in records)
    fig, axes = plt.subplots(1, 3 if gold else 2, figsize=(15 if gold else 10, 3.6))
    _reward_panel(axes[0], records, its)
    _kl_panel(axes[1], records, kl_budget)
    if gold:
        _gold_panel(axes[2], records)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(out_png), dpi=100)
    plt.close(fig)


def budget_on_scale(values: Sequence[float], budget: float) -> bool:
    """Whether ``stop.kl_budget`` is drawn as a line on the KL panel: when the KL reaches a quarter of
    it, so that the curve still spans a quarter of the panel's height. Further below, a line would
    set the axis and flatten the curve at its foot (0.05 nats under a 20-nat line): the budget is a
    note instead."""
    return bool(values) and max(values) >= budget / 4


def _kl_panel(ax, records: list[dict[str, float]], kl_budget: float | None) -> None:
    """KL(pi || pi_ref) per response against the iteration: the k1 mean (``kl/ref_mean``, which the
    stop rule reads) and, where logged, the k3 mean; the budget as a line or, off the scale, a note."""
    drawn = (("kl/ref_mean", "k1 (the stop rule's)", "-"), ("kl/ref_k3_mean", "k3 (>= 0)", ":"))
    lines = [(label, style, [(r["iteration"], r[key]) for r in records if key in r]) for key, label, style in drawn]
    for label, style, points in lines:
        if points:
            ax.plot(*zip(*points), marker=".", linestyle=style, color="tab:red", label=label)
    values = [v for _, _, points in lines for _, v in points]  # none at kl_coef = 0
    ax.set(title="KL(pi || pi_ref), nats per response" + ("" if values else ": no reference (ppo.kl_coef = 0)"),
           xlabel="iteration")
    if not values:
        return
    if kl_budget is not None and budget_on_scale(values, kl_budget):
        ax.axhline(kl_budget, linestyle="--", color="grey", label="stop.kl_budget")
    elif kl_budget is not None:
        ax.text(0.02, 0.96, f"stop.kl_budget = {kl_budget:g} nats, off this scale", transform=ax.transAxes,
                va="top", fontsize="small", color="grey")
    ax.legend(fontsize="small")


GOLD_FIGURE = "gold/proxy_and_gold_vs_kl"
"""The trackers' name for ``gold_figure``: TensorBoard's Images tab, W&B's media, MLflow's artifacts."""


def gold_figure(records: list[dict[str, float]]) -> Figure:
    """The third panel of ``plot.png`` alone (``_gold_panel``), for the trackers. Made without
    pyplot's figure manager, so that nothing holds it once a tracker has drawn it."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3.6))
    _gold_panel(figure.subplots(), records)
    figure.tight_layout()
    return figure


def kl_estimate(record: dict[str, float]) -> float | None:
    """A record's KL(pi || pi_ref) per response as an axis can show it, >= 0: its k3 mean
    (``kl/ref_k3_mean``); in a record without one (a run from before it was logged) the k1 mean
    clipped at 0, since a k1 mean below 0 is sampling noise around a KL that cannot be negative, and
    0 is the nearest value the KL can take. None without a reference."""
    if "kl/ref_k3_mean" in record:
        return record["kl/ref_k3_mean"]
    return max(0.0, record["kl/ref_mean"]) if "kl/ref_mean" in record else None


@dataclass(frozen=True)
class Curve:
    """One line of a panel: its points in the order they are joined."""

    x: list[float]
    y: list[float]


GOLD_LINES = {"proxy (reward/mean)": ("reward/mean", "reward/gold_mean"),
              "gold (reward/gold_mean)": ("reward/gold_mean", "reward/gold_mean"),
              "held-out proxy": ("eval/reward/mean", "eval/gold/mean"),
              "held-out gold": ("eval/gold/mean", "eval/reward/mean")}
"""The proxy-and-gold panel's lines: label -> (the value drawn, the other key a record needs to be on
it: a held-out point is drawn where both held-out means are)."""


def gold_curves(records: list[dict[str, float]]) -> tuple[str, dict[str, Curve]]:
    """The proxy-and-gold panel's x axis label and lines (``GOLD_LINES``; one with no points left
    out). x is KL(pi || pi_ref) per response (``kl_estimate``) where every record scored by gold has
    one, else the iteration; each line's points are sorted by x, so that a KL that falls for an
    iteration moves a point left instead of turning the line back across the others."""
    rows = [r for r in records if "reward/gold_mean" in r]
    kl = bool(rows) and all(kl_estimate(r) is not None for r in rows)

    def x(record: dict[str, float]) -> float:
        value = kl_estimate(record) if kl else record["iteration"]
        assert value is not None  # kl: every row has one
        return value

    curves = {}
    for label, (key, needs) in GOLD_LINES.items():
        points = sorted((x(r), r[key]) for r in rows if key in r and needs in r)
        if points:
            curves[label] = Curve([p for p, _ in points], [v for _, v in points])
    return ("KL(pi || pi_ref), nats per response" if kl else "iteration"), curves


def _gold_panel(ax, records: list[dict[str, float]]) -> None:
    """Proxy (the trained-on reward) and gold (``reward.gold_function``) against KL(pi || pi_ref):
    the figure of reward-model over-optimisation (Gao, Schulman and Hilton 2022, fig. 1). Against
    the iteration where no reference runs (no KL)."""
    xlabel, curves = gold_curves(records)
    for label, curve in curves.items():
        held = label.startswith("held-out")
        ax.plot(curve.x, curve.y, "s--" if held else ".-", alpha=0.6 if held else 1.0,
                color="tab:orange" if "gold" in label else "tab:blue", label=label)
    ax.set(title="proxy and gold reward", xlabel=xlabel)
    ax.legend(fontsize="small")


def _column(records: list[dict[str, float]], key: str) -> list[float]:
    """``key`` of every record, NaN where missing (matplotlib leaves a gap there)."""
    return [r.get(key, math.nan) for r in records]


def _reward_panel(ax, records: list[dict[str, float]], its: list[float]) -> None:
    mean = _column(records, "reward/mean")
    if any("reward/min" in r and "reward/max" in r for r in records):
        ax.fill_between(its, _column(records, "reward/min"), _column(records, "reward/max"), color="tab:blue",
                        alpha=0.12, linewidth=0, label="batch min..max")
    if any("reward/std" in r for r in records):
        std = _column(records, "reward/std")
        ax.fill_between(its, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color="tab:blue", alpha=0.25, linewidth=0, label="mean ± std")
    ax.plot(its, mean, marker=".", color="tab:blue", label="batch mean")
    for key, label, color in (("eval/reward/mean", "held-out", "tab:green"),
                              ("eval/greedy/reward/mean", "held-out (greedy)", "tab:orange")):
        evals = [(r["iteration"], r[key]) for r in records if key in r]
        if evals:
            ax.plot(*zip(*evals), marker="o", color=color, label=label)
    ax.set(title="reward r_phi", xlabel="iteration")
    if len(ax.get_legend_handles_labels()[1]) > 1:
        ax.legend(fontsize="small")
