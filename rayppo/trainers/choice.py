"""Which trainer runs a config: the one place the choice is made.

    trainer=reference                      InProcessTrainer   (one process, transformers only)
    trainer=distributed                    DistributedTrainer (on Ray), whose rollout source is
        max_staleness=0                    SynchronousSource  (generate, score, learn, sync in turn)
        max_staleness>0                    PipelinedSource    (generation, scoring, learning overlapped)

The rollout source is chosen by ``distributed.source_class``, at the one call site that builds it.

The modules are imported on demand: the in-process trainer never imports Ray.
"""

from __future__ import annotations

from typing import Any

from rayppo.config.schema import Config


def trainer_class(cfg: Config) -> type:
    """The trainer class for ``cfg`` (module docstring)."""
    if cfg.trainer == "reference":
        from rayppo.trainers.inprocess import InProcessTrainer

        return InProcessTrainer
    from rayppo.trainers.distributed import DistributedTrainer

    return DistributedTrainer


def make_trainer(cfg: Config) -> Any:
    """A started trainer of ``trainer_class(cfg)`` (the distributed ones have spawned their actors)."""
    return trainer_class(cfg)(cfg)
