"""The scalar head of a reward-model folder, read back to start a critic from r_φ
(``loading.Critic.from_pretrained``). A reward-model folder is what ``save_pretrained`` of a
one-label transformers sequence classifier writes (``reward_model.py``): the head is
``score.weight`` ``[1, hidden]``, a linear layer without bias in the families rayppo trains
(transformers 5.19, ``LlamaForSequenceClassification``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

HEAD = "score.weight"
"""The classifier head's tensor in a reward-model folder."""


def reward_head(path: str | Path) -> torch.Tensor | None:
    """``[1, hidden]`` the scalar head of a reward-model folder (one label), None for any other
    folder: what a critic started from r_φ takes as its value head (InstructGPT's choice,
    Ouyang et al. 2022, arXiv:2203.02155, section 3.5: "we initialize the value function from the RM")."""
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
                return f.get_tensor(HEAD)
    return None
