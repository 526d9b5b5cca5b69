"""A reward model's offset and unit on its held-out responses (``reward_stats.json`` beside it):
written by ``rayppo reward-model``, read by the reward actor with ``reward.normalize``. Plain
JSON and arithmetic: ``rayppo plan`` and the input checks read it before torch loads."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rayppo.errors import ModelFolderError

STATS_FILE = "reward_stats.json"
"""r_φ's offset and scale on its held-out responses, written beside the model by ``rayppo reward-model``."""


@dataclass
class RewardStats:
    """Mean and standard deviation of r_φ over the 2P responses of its held-out pairs: the reward
    actor serves (r_φ − mean) / std with ``reward.normalize`` (docs/reward-models.md, "Reward
    normalisation": Bradley–Terry fixes neither r_φ's offset nor, against the KL term, its unit)."""

    mean: float
    std: float
    responses: int
    """How many scores the figures come from."""

    @classmethod
    def of(cls, scores: list[float]) -> RewardStats:
        n = len(scores)
        mean = sum(scores) / n
        return cls(mean, math.sqrt(sum((x - mean) ** 2 for x in scores) / n), n)

    def write(self, folder: str | Path) -> None:
        (Path(folder) / STATS_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> RewardStats | None:
        """The folder's figures; None when it has none (a reward model from elsewhere). A file
        that is unreadable, or whose scale is not a positive number, is an error naming it."""
        path = Path(folder) / STATS_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            stats = cls(float(data["mean"]), float(data["std"]), int(data["responses"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFolderError(f"{path}: not a reward-statistics file ({type(exc).__name__}: {exc}); delete it, or "
                             "set reward.normalize=false") from None
        if not (math.isfinite(stats.mean) and math.isfinite(stats.std) and stats.std > 0):
            raise ModelFolderError(f"{path}: mean {stats.mean} and std {stats.std} cannot normalise scores (std must be > 0); "
                             "set reward.normalize=false")
        return stats
