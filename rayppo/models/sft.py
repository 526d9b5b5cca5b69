"""Supervised warm-up ("SFT"): teach a causal LM a task's format before PPO.

The loss is the mean negative log-likelihood of the response tokens (and the EOS that ends
them) given the prompt; prompt tokens are context only. The result becomes pi_ref.
"""

from __future__ import annotations

import random

import torch
from tqdm import tqdm

from rayppo.learner.ppo import masked_mean
from rayppo.models.sequences import pack, policy_forward


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    examples: list[tuple[str, str]],
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Train ``model`` in place on (prompt, response) text pairs; returns the loss per step."""
    encoded = [
        (tokenizer(p, add_special_tokens=True)["input_ids"], tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        for p, r in examples
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    steps = epochs * (len(encoded) // batch_size)
    losses: list[float] = []
    model.train()
    with tqdm(total=steps, desc="SFT warm-up", disable=not progress, leave=False) as bar:
        for _ in range(epochs):
            rng.shuffle(encoded)
            for start in range(0, len(encoded) - batch_size + 1, batch_size):
                chunk = encoded[start : start + batch_size]
                batch = pack([p for p, _ in chunk], [r for _, r in chunk], tokenizer.pad_token_id)
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
