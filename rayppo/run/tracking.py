"""Where a run's metrics and sample completions go besides ``metrics.jsonl``: TensorBoard, Weights &
Biases, MLflow.

    trackers = make_trackers(cfg, to_dict(cfg), resume=False)   # what output.* asks for
    tracker.log(iteration, {"reward/mean": 0.41, ...})
    tracker.log_samples(iteration, [Sample(prompt, response, reward), ...])
    tracker.close()

Each backend is a plain class behind the ``Tracker`` protocol; ``rayppo.run.metrics.MetricsLogger``
fans every record out to them. wandb and mlflow are imported only when configured, and
``check_trackers`` tells a missing package apart before anything heavy is imported.

A run folder remembers its W&B and MLflow run ids (``wandb_run_id``, ``mlflow_run_id``), so
``rayppo train --resume DIR`` continues the same runs there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rayppo.config.schema import Config, ConfigError
from rayppo.errors import RayppoError, brief

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from torch.utils.tensorboard import SummaryWriter

    from rayppo.choices import WandbMode
    from rayppo.run.samples import Sample

INSTALL_HINT = "(pip install 'rayppo[track]')"
WANDB_ID_FILE, MLFLOW_ID_FILE = "wandb_run_id", "mlflow_run_id"


class Tracker(Protocol):
    """One destination of a run's records, keyed by PPO iteration."""

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of one iteration."""

    def log_samples(self, iteration: int, samples: Sequence[Sample]) -> None:
        """Record a few (prompt, response, reward) completions of one iteration."""

    def log_figure(self, iteration: int, name: str, figure: Figure) -> None:
        """Record a matplotlib figure drawn at ``iteration`` (the proxy-and-gold-against-KL panel)."""

    def rewind(self, iteration: int) -> None:
        """The run goes on from ``iteration``: records at or after it are about to be redone."""

    def close(self) -> None:
        """Flush and end; the tracker is not used afterwards."""


def check_trackers(cfg: Config) -> None:
    """The packages the tracking options need are installed. Looks them up without importing
    them, so the command line can call it before anything heavy is imported."""
    out = cfg.output
    if out.wandb_project and out.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"output.wandb_project: the wandb package is not installed {INSTALL_HINT}")
    if out.mlflow_uri and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"output.mlflow_uri: the mlflow package is not installed {INSTALL_HINT}")


def run_name(cfg: Config) -> str:
    """``output.run_name``, else the last part of ``output.dir``."""
    return cfg.output.run_name or Path(cfg.output.dir).resolve().name


def make_trackers(cfg: Config, resolved_config: dict[str, Any], resume: bool) -> list[Tracker]:
    """The trackers ``output.*`` asks for. ``resolved_config`` (``to_dict(cfg)``) goes to W&B and
    MLflow; ``resume``: continue the W&B and MLflow runs recorded in ``output.dir``.
    TensorBoard's redone iterations are dropped by ``Tracker.rewind`` (``MetricsLogger`` calls it)."""
    check_trackers(cfg)
    out = Path(cfg.output.dir).resolve()
    trackers: list[Tracker] = []
    out.mkdir(parents=True, exist_ok=True)
    try:
        if cfg.output.tensorboard:
            trackers.append(TensorBoardTracker(out / "tb"))
        if cfg.output.wandb_project and cfg.output.wandb_mode != "disabled":
            trackers.append(WandbTracker(out, cfg.output.wandb_project, run_name(cfg), cfg.output.wandb_mode,
                                         resolved_config, resume))
        if cfg.output.mlflow_uri:
            experiment = cfg.output.wandb_project or "rayppo"
            trackers.append(MlflowTracker(out, cfg.output.mlflow_uri, experiment, run_name(cfg), resolved_config,
                                          resume))
    except BaseException:
        for tracker in trackers:  # e.g. W&B started, then MLflow failed: end the W&B run too
            tracker.close()
        raise
    return trackers


def _read_id(path: Path, resume: bool) -> str | None:
    """The run id saved in ``path`` when resuming; None for a new run or when none was saved."""
    if resume and path.is_file():
        return path.read_text(encoding="utf-8").strip() or None
    return None


class TensorBoardTracker:
    """Scalars and sample tables as TensorBoard event files in ``log_dir``.

    The writer opens on first use, so that a ``rewind`` before it (a resumed run) becomes its
    ``purge_step``: TensorBoard then hides the events at or after that step written by the
    interrupted attempt, and the redone iterations do not appear twice."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = None
        self._purge_step: int | None = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """One scalar per metric at step ``iteration``."""
        writer = self._open()
        for key, value in metrics.items():
            writer.add_scalar(key, value, iteration)

    def log_samples(self, iteration: int, samples: Sequence[Sample]) -> None:
        """The samples as one Markdown table under the text tag ``samples``."""
        rows = [f"| {s.reward:.4g} | {_md_cell(s.prompt)} | {_md_cell(s.response)} |" for s in samples]
        table = "\n".join(["| reward | prompt | response |", "| ---: | --- | --- |", *rows])
        self._open().add_text("samples", table, iteration)

    def log_figure(self, iteration: int, name: str, figure: Figure) -> None:
        """The figure as an image under ``name`` (the Images tab, a slider over iterations)."""
        self._open().add_figure(name, figure, iteration, close=False)

    def rewind(self, iteration: int) -> None:
        """Close the event file; the next one purges steps >= ``iteration``."""
        self.close()
        self._purge_step = iteration

    def close(self) -> None:
        """Flush and close the event file (a later record opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _md_cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, line breaks as <br>."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


class WandbTracker:
    """A Weights & Biases run: metrics against an ``iteration`` axis, samples as a ``wandb.Table``.

    The run id is kept in ``out_dir/wandb_run_id``; a resumed run passes it back to
    ``wandb.init`` and continues that run. Metrics are plotted against the logged ``iteration``
    rather than W&B's own step, which must only increase: after a rewind the redone iterations
    are logged again at their iteration (W&B keeps both points; its history cannot be cut)."""

    def __init__(self, out_dir: Path, project: str, name: str, mode: WandbMode, config: dict[str, Any], resume: bool):
        # wandb advertises its Weave LLM tracing on the terminal when it sees an LLM client
        # library imported (vLLM brings openai); rayppo does not use Weave.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        import wandb

        self._wandb = wandb
        id_file = out_dir / WANDB_ID_FILE
        run_id = _read_id(id_file, resume)
        # silent: no banners or run summary in the user's terminal (rayppo prints its own);
        # console off: wandb does not wrap stdout/stderr, which the progress bar redraws in place.
        settings = wandb.Settings(silent=True, console="off")
        try:
            self._run = wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, config=config,
                                   id=run_id, resume="allow" if run_id else None, settings=settings)
        except Exception as exc:  # no API key, unreachable server, ...: one line naming the option
            raise RayppoError(f"output.wandb_project: wandb.init failed ({brief(exc)}); "
                              "output.wandb_mode=offline logs without a server") from exc
        id_file.write_text(self._run.id + "\n", encoding="utf-8")
        self._run.define_metric("*", step_metric="iteration")

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """The metrics, with ``iteration`` as their x axis."""
        self._run.log({"iteration": iteration, **metrics})

    def log_samples(self, iteration: int, samples: Sequence[Sample]) -> None:
        """A table ``samples`` (iteration, reward, prompt, response)."""
        table = self._wandb.Table(columns=["iteration", "reward", "prompt", "response"],
                                  data=[[iteration, s.reward, s.prompt, s.response] for s in samples])
        self._run.log({"iteration": iteration, "samples": table})

    def log_figure(self, iteration: int, name: str, figure: Figure) -> None:
        """The figure as an image under ``name``."""
        self._run.log({"iteration": iteration, name: self._wandb.Image(figure)})

    def rewind(self, iteration: int) -> None:
        """Nothing to drop: W&B history is append-only (see the class docstring)."""

    def close(self) -> None:
        """End the run (offline: its files under ``out_dir/wandb`` are complete)."""
        self._run.finish()


MLFLOW_NAME_LIMIT = 250
"""Longest metric or param key MLflow stores."""


def mlflow_tracking_uri(uri: str) -> str:
    """``output.mlflow_uri`` as an MLflow tracking URI: a URI (``http://``, ``file:``, ...) as
    given; a local folder, created, as a ``file:`` URI of its absolute path.

    A folder is MLflow's file store. MLflow 3.7+ keeps it in maintenance mode and refuses it
    unless ``MLFLOW_ALLOW_FILE_STORE`` is set; its replacement (``sqlite:``) needs SQLAlchemy,
    which mlflow-skinny does not install. So a file store is allowed here, unless the user
    decided otherwise in the environment."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri):  # a scheme; one letter would be a drive (C:\runs)
        tracking_uri = uri
    else:
        folder = Path(uri).expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True)
        tracking_uri = folder.as_uri()
    if tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return tracking_uri


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts (alphanumerics, ``_ - . : /`` and spaces, no
    path tricks, at most 250 characters): ``eval/pass@4`` -> ``eval/pass_at_4``."""
    cleaned = re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key.replace("@", "_at_"))
    # MLflow treats names as file paths and refuses ones that normalise to another name.
    parts = ["__" if part == ".." else part for part in cleaned.split("/") if part not in ("", ".")]
    return "/".join(parts)[:MLFLOW_NAME_LIMIT] or "_"


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config dicts as ``{"ppo.clip_eps": "0.2", ...}``: strings as they are, other
    values as JSON (``true``, ``null``, ``[1, 2]``)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class MlflowTracker:
    """An MLflow run: the resolved config as params, metrics at ``step=iteration``, samples as
    ``samples/iter_NNNNNN.txt`` artifacts.

    Uses ``MlflowClient`` only (no process-wide active run). The run id is kept in
    ``out_dir/mlflow_run_id``; a resumed run continues it, without logging params again (MLflow
    refuses to change a param, and resume overrides may change ``stop.*`` or ``output.*``).
    After a rewind the redone iterations add a second value at their step (history is
    append-only)."""

    def __init__(self, out_dir: Path, uri: str, experiment: str, name: str, config: dict[str, Any], resume: bool):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._uri = mlflow_tracking_uri(uri)
        try:
            self._client = MlflowClient(tracking_uri=self._uri)
            self.run_id = self._resumed_run(_read_id(out_dir / MLFLOW_ID_FILE, resume))
            if self.run_id is None:
                self.run_id = self._client.create_run(self._experiment_id(experiment), run_name=name).info.run_id
                self._log_params(flatten_config(config))
        except MlflowException as exc:
            raise RayppoError(f"output.mlflow_uri: {uri}: {brief(exc)}") from exc
        (out_dir / MLFLOW_ID_FILE).write_text(self.run_id + "\n", encoding="utf-8")

    def _resumed_run(self, run_id: str | None) -> str | None:
        """``run_id`` set running again, or None when there is none or the store lost it (a new
        ``output.mlflow_uri``: a new run there)."""
        from mlflow.exceptions import MlflowException

        if run_id is None:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException:
            return None
        return run_id

    def _experiment_id(self, name: str) -> str:
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        entries = [Param(mlflow_key(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for batch in _chunks(entries, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=batch)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Every metric at ``step=iteration`` (names through ``mlflow_key``)."""
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_key(k), float(v), now, iteration) for k, v in metrics.items()]
        for batch in _chunks(entries, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, iteration: int, samples: Sequence[Sample]) -> None:
        """The samples, full text, as ``samples/iter_NNNNNN.txt``."""
        blocks = [f"reward: {s.reward:.6g}\nprompt:\n{s.prompt}\nresponse:\n{s.response}\n" for s in samples]
        self._client.log_text(self.run_id, "\n".join(blocks), f"samples/iter_{iteration:06d}.txt")

    def log_figure(self, iteration: int, name: str, figure: Figure) -> None:
        """The figure as the artifact ``NAME/iter_NNNNNN.png``."""
        self._client.log_figure(self.run_id, figure, f"{name}/iter_{iteration:06d}.png")

    def rewind(self, iteration: int) -> None:
        """Nothing to drop: MLflow history is append-only (see the class docstring)."""

    def close(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self.run_id)
