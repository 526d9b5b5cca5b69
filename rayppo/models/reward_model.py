"""r_φ as a model: a causal-LM backbone given a scalar head (a transformers sequence classifier
with one label); ``reward_head.py`` reads that head back to start a critic from it.

A reward-model folder is what ``save_pretrained`` of such a classifier writes: ``config.json``
(``*ForSequenceClassification``, ``num_labels`` 1, the ``pad_token_id`` the classifier skips to
find each row's last token) and its weights, the backbone's under ``model.`` and the head as
``score.weight`` ``[1, hidden]`` (transformers 5.19, ``LlamaForSequenceClassification``: a linear
layer without bias, the families rayppo trains).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from rayppo.models.loading import DTYPES, no_dropout


def backbone_name(cfg: Any) -> str:
    """The model r_φ starts from: ``preference.backbone``, else ``model.policy``."""
    return cfg.preference.backbone or cfg.model.policy


def scalar_head_model(path: str | Path, dtype: str, pad_id: int, seed: int) -> PreTrainedModel:
    """The folder's model as a one-label sequence classifier, dropout off: a causal LM's
    backbone with a new head (drawn from ``seed``, the same on every rank), or a reward-model
    folder as it is (its head kept, to train further)."""
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False, num_labels=1, pad_token_id=pad_id,
                                        **no_dropout(path))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized: score.weight" / "unused: lm_head" are the point here
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForSequenceClassification.from_pretrained(
                str(path), config=config, dtype=DTYPES[dtype], trust_remote_code=False, use_safetensors=True)
    finally:
        hf_logging.set_verbosity(verbosity)
