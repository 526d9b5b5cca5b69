"""The scalar head of a reward-model folder, read back to start a critic from r_φ
(``loading.Critic.from_pretrained``). A reward-model folder is what ``save_pretrained`` of a
one-label transformers sequence classifier writes (``reward_model.py``): the head is
``score.weight`` ``[1, hidden]``, a linear layer without bias in the families rayppo trains
(transformers 5.19, ``LlamaForSequenceClassification``). A critic whose returns are in the unit
the reward actor serves r_φ in (``reward.normalize``: (r_φ − mean) / std by ``reward_stats.json``)
starts from the head in that unit too, or its first values are off by r_φ's offset and scale."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from rayppo.models.reward_stats import RewardStats

HEAD = "score.weight"
"""The classifier head's tensor in a reward-model folder."""


def reward_head(path: str | Path, normalize: bool = False) -> tuple[torch.Tensor, float] | None:
    """``([1, hidden] weight, bias)`` of the scalar head of a reward-model folder (one label), None
    for any other folder: what a critic started from r_φ takes as its value head (InstructGPT's
    choice, Ouyang et al. 2022, arXiv:2203.02155, section 3.5: "we initialize the value function
    from the RM"). ``normalize`` and a ``reward_stats.json`` beside it: the head of
    (r_φ − mean) / std = (w / std)·h − mean / std, the score the reward actor serves."""
    folder = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError):
        return None
    classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if not classifier or config.num_labels != 1:
        return None
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if HEAD in f.keys():
                weight = f.get_tensor(HEAD)
                stats = RewardStats.read(folder) if normalize else None
                return (weight, 0.0) if stats is None else (weight.float() / stats.std, -stats.mean / stats.std)
    return None
