"""The ``preference`` section: training a reward model r_φ on preference pairs
(``rayppo reward-model``, docs/reward-models.md).

The reward-model run also reads ``model`` (its dtype, cache), ``learner`` (ranks, ZeRO stage,
threads), ``ppo.max_grad_norm``, ``output`` (folder, checkpoints) and ``cluster``, as ``train``
does; this section holds what only it needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PreferenceConfig:
    pairs: str = ""
    """Preference pairs r_φ is trained on: a ``.jsonl`` / ``.parquet`` file or a ``datasets``
    folder with columns ``prompt`` (text or ``{role, content}`` messages), ``chosen`` and
    ``rejected`` (docs/reward-models.md). ``rayppo pairs`` writes this file from a verifier."""
    backbone: str = ""
    """The model r_φ starts from, given a scalar head (a built-in name or a folder; empty: ``model.policy``).
    Its tokenizer and chat template are r_φ's and are saved with it."""
    held_out: float = 0.1
    """Fraction of the pairs held out (a seeded split) for the pairwise accuracy and margin
    reported after each epoch and at the end."""
    epochs: int = 1
    """Passes over the training pairs, each in a fresh seeded order."""
    batch_pairs: int = 32
    """Pairs per optimiser step over all learner ranks (a multiple of ``learner.num_ranks``); an
    epoch's last pairs that do not fill a step are left for the next epoch's order."""
    micro_pairs: int = 8
    """Pairs per forward/backward on one rank (both responses of each: 2x rows); memory, not math."""
    lr: float = 1e-5
    """AdamW learning rate of r_φ (backbone and head)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_tokens: int = 512
    """Longest prompt + response text in r_φ's tokens; a pair over it is refused naming its row."""
    eval_every: int = 0
    """Optimiser steps between held-out evaluations (0: after each epoch only)."""
    samples_per_prompt: int = 8
    """``rayppo pairs``: responses the policy samples per prompt of ``data.prompts`` for the
    verifier (``reward.function``) to score."""
    pairs_per_prompt: int = 2
    """``rayppo pairs``: at most this many pairs per prompt, the best-scored response with the
    worst, the second with the second last, ... where the verifier strictly prefers one."""
    max_pairs: int = 0
    """``rayppo pairs``: stop once this many pairs are written (0: sample every prompt of ``data.prompts``)."""
