"""Run outputs: one JSON line per iteration (also fanned out to the trackers: TensorBoard, W&B,
MLflow), a few sample completions, and a PNG of reward and KL."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
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
    ax_r, ax_k = axes[0], axes[1]
    _reward_panel(ax_r, records, its)
    if gold:
        _gold_panel(axes[2], records)
    kl = [(r["iteration"], r["kl/ref_mean"]) for r in records if "kl/ref_mean" in r]  # none at kl_coef = 0
    ax_k.plot([i for i, _ in kl], [v for _, v in kl], marker=".", color="tab:red")
    ax_k.set(title="KL(pi || pi_ref), nats per response" + ("" if kl else ": no reference (ppo.kl_coef = 0)"),
             xlabel="iteration")
    if kl_budget is not None:
        ax_k.axhline(kl_budget, linestyle="--", color="grey", label="stop.kl_budget")
        ax_k.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(out_png), dpi=100)
    plt.close(fig)


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


def _gold_panel(ax, records: list[dict[str, float]]) -> None:
    """Proxy (the trained-on reward) and gold (``reward.gold_function``) against KL(pi || pi_ref):
    the figure of reward-model over-optimisation (Gao, Schulman and Hilton 2022, fig. 1). Against
    the iteration where no reference runs (no KL)."""
    rows = [r for r in records if "reward/gold_mean" in r]
    kl = all("kl/ref_mean" in r for r in rows)
    x = [r["kl/ref_mean"] if kl else r["iteration"] for r in rows]
    ax.plot(x, [r["reward/mean"] for r in rows], marker=".", color="tab:blue", label="proxy (reward/mean)")
    ax.plot(x, [r["reward/gold_mean"] for r in rows], marker=".", color="tab:orange", label="gold (reward/gold_mean)")
    held = [r for r in rows if "eval/gold/mean" in r and "eval/reward/mean" in r]
    if held:
        hx = [r["kl/ref_mean"] if kl else r["iteration"] for r in held]
        ax.plot(hx, [r["eval/reward/mean"] for r in held], "s--", color="tab:blue", alpha=0.6, label="held-out proxy")
        ax.plot(hx, [r["eval/gold/mean"] for r in held], "s--", color="tab:orange", alpha=0.6, label="held-out gold")
    ax.set(title="proxy and gold reward", xlabel="KL(pi || pi_ref), nats per response" if kl else "iteration")
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
