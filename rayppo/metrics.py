"""Run outputs: one JSON line per iteration, TensorBoard events, and a PNG of reward and KL."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    """Writes ``metrics.jsonl`` (and ``tb/`` events) under the run folder."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_at: int | None = None):
        """``resume_at=k``: continue a run from iteration k. Records of iterations >= k (written
        after the checkpoint, before the run stopped) are dropped, from TensorBoard too, so
        the resumed iterations replace them instead of appearing twice."""
        self.dir, self.tensorboard = Path(out_dir), tensorboard
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._open(resume_at)

    def _open(self, resume_at: int | None) -> None:
        if resume_at is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if r["iteration"] < resume_at]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = self.path.open("w" if resume_at is None else "a", encoding="utf-8")
        self._tb = None
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"), purge_step=resume_at)

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, iteration)

    def rewind(self, iteration: int) -> None:
        """Continue at ``iteration``, later records dropped: after the run went back to an
        earlier checkpoint, the iterations it redoes replace the first attempt's."""
        self.close()
        self._open(iteration)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(records: list[dict[str, float]], out_png: str | Path, kl_budget: float | None = None) -> None:
    """Reward and KL(pi || pi_ref) per iteration, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in records]
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_r.plot(its, [r["reward/mean"] for r in records], marker=".")
    ax_r.set(title="mean reward r_phi", xlabel="iteration")
    ax_k.plot(its, [r["kl/ref_mean"] for r in records], marker=".", color="tab:red")
    ax_k.set(title="KL(pi || pi_ref), nats per response", xlabel="iteration")
    if kl_budget is not None:
        ax_k.axhline(kl_budget, linestyle="--", color="grey", label="stop.kl_budget")
        ax_k.legend()
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(out_png), dpi=100)
    plt.close(fig)
