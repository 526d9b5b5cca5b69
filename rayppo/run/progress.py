"""The progress bar of a run (or, without a terminal, a plain line every tenth of it)."""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from rayppo.console import console


class Bar:
    """The progress bar: iterations, ETA, and the figures a user watches (reward, held-out
    reward, KL, tokens/s). The last evaluation's reward stays on it until the next one. When
    stderr is not a terminal (a log file, CI, nohup) there is no bar, whose redraws would fill the
    log: one plain line every tenth of the run (and the last, also of a run stopped early) says the same."""

    def __init__(self, total: int, first: int, enabled: bool, desc: str = "PPO", unit: str = "it",
                 figures: Callable[[dict[str, float]], dict[str, str]] | None = None) -> None:
        """``figures``: what the bar shows of a step's metrics (default: a PPO iteration's)."""
        self.lines = enabled and not console.out.isatty()  # the terminal, also while Console.captured
        self.done, self.total, self.every = first, total, max(1, total // 10)
        self.desc, self.figures = desc, figures or self._ppo_figures
        self.bar = tqdm(total=total, initial=first, desc=desc, unit=unit, disable=not enabled or self.lines,
                        file=console.out, dynamic_ncols=True)
        self.eval: str | None = None
        self.unsaid: str | None = None
        """Without a terminal: the last step's line, until a line is written for it."""

    def _ppo_figures(self, metrics: dict[str, float]) -> dict[str, str]:
        if "eval/reward/mean" in metrics:
            self.eval = f"{metrics['eval/reward/mean']:.3f}"
            if "distill/reached" in metrics:  # on-policy distillation: the share of the teacher's score
                self.eval += f" (teacher: {metrics['distill/reached']:.0%} reached)"
        return {"reward": f"{metrics['reward/mean']:.3f}", **({"eval": self.eval} if self.eval else {}),
                **({"kl": f"{metrics['kl/ref_mean']:.2f}"} if "kl/ref_mean" in metrics else {}),
                **({"kl_teacher": f"{metrics['distill/reverse_kl_mean']:.3f}"}
                   if "distill/reverse_kl_mean" in metrics else {}),
                "tok/s": f"{metrics['throughput/tokens_per_s']:.0f}"}

    def update(self, metrics: dict[str, float]) -> None:
        """One more step done, with its ``metrics``."""
        shown = self.figures(metrics)
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update()
        self.done += 1  # a disabled tqdm does not count
        self.unsaid = f"{self.desc} {self.done}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
        if self.lines and (self.done % self.every == 0 or self.done == self.total):
            console.write(self.unsaid)
            self.unsaid = None

    def rewind(self, iteration: int) -> None:
        """Back to ``iteration`` (a learner restart redoes the iterations since its checkpoint)."""
        self.done = self.bar.n = iteration
        self.unsaid = None
        self.bar.refresh()

    def close(self) -> None:
        """The bar leaves the terminal; without one, the last step gets its line if no tenth gave it one."""
        if self.lines and self.unsaid is not None:
            console.write(self.unsaid)
        self.bar.close()
