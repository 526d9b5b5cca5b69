"""Supervised warm-up ("SFT"): teach a causal LM a task's format before PPO.

The loss is the mean negative log-likelihood of the response tokens (and the EOS that ends
them) given the prompt; prompt tokens are context only. The result becomes pi_ref.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from rayppo.models.sequences import pack, policy_forward
from rayppo.token_math import masked_mean


@dataclass(frozen=True)
class SFTSettings:
    """How the warm-up trains: its epochs, batches, learning rate and shuffling seed."""

    epochs: int = 3
    """Passes over the examples."""
    batch_size: int = 64
    """Examples per step; a last part smaller than that is left out of the epoch."""
    lr: float = 1e-3
    """AdamW's learning rate."""
    seed: int = 0
    """The seed of each epoch's shuffle."""
    progress: bool = True
    """A progress bar on a terminal (never in a log)."""


def sft_train(model: torch.nn.Module, tokenizer, examples: list[tuple[str, str]],
              settings: SFTSettings = SFTSettings()) -> list[float]:
    """Train ``model`` in place on (prompt, response) text pairs; returns the loss per step."""
    encoded = [
        (tokenizer(p, add_special_tokens=True)["input_ids"], tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], None)
        for p, r in examples
    ]
    return sft_train_ids(model, tokenizer.pad_token_id, encoded, settings)


TokenExample = tuple[list[int], list[int], list[int] | None]
"""(prompt ids, response ids, the response tokens trained on: 1/0 per token, None for all of them;
a multi-turn episode trains its own turns, not the environment's replies between them)."""


def sft_train_ids(model: torch.nn.Module, pad_id: int, examples: Sequence[TokenExample],
                  settings: SFTSettings = SFTSettings()) -> list[float]:
    """``sft_train`` over token ids (and masks); returns the loss per step."""
    epochs, batch_size, lr, seed, progress = (settings.epochs, settings.batch_size, settings.lr, settings.seed,
                                              settings.progress)
    encoded = list(examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    steps = epochs * (len(encoded) // batch_size)
    losses: list[float] = []
    model.train()
    # A bar only on a terminal: in a log (make train > log, CI, nohup) its redraws are ~200 lines.
    with tqdm(total=steps, desc="SFT warm-up", disable=not progress or not sys.stderr.isatty(), leave=False) as bar:
        for _ in range(epochs):
            rng.shuffle(encoded)
            for start in range(0, len(encoded) - batch_size + 1, batch_size):
                chunk = encoded[start : start + batch_size]
                masks = [m if m is not None else [1] * len(r) for _, r, m in chunk]
                batch = pack([p for p, _, _ in chunk], [r for _, r, _ in chunk], pad_id, masks)
                logprobs, _ = policy_forward(model, batch)
                loss = -masked_mean(logprobs, batch.mask)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                bar.set_postfix(nll=f"{losses[-1]:.3f}")
                bar.update()
    model.eval()
    return losses
