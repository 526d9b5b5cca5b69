"""The embedded default task: "say a digit".

A prompt names a target digit ("say 7 :"); the response is a short list of digits. The verifier
rewards the share of response tokens that are the target digit, counted over at least
``MIN_LENGTH`` tokens so that a one-token answer cannot win, and gives 0 to an answer longer
than ``MAX_LENGTH`` (the format asks for 3 to 8 digits, so rambling on is wrong). The warmed-up ("SFT") policy
writes the target about 30% of the time, so PPO starts near 0.35 and can climb towards 1.0:
a visible learning signal in a few minutes on two CPU cores.
"""

from __future__ import annotations

import random

VERBS = ("say", "write", "repeat", "give")
DIGITS = tuple(str(d) for d in range(10))
MIN_LENGTH = 4
"""Responses shorter than this are scored as if padded with wrong tokens."""
MAX_LENGTH = 8
"""Responses longer than this score 0."""
SFT_TARGET_RATE = 0.3
"""How often the warm-up data writes the target digit (the rest are uniform digits)."""


def make_prompt(verb: str, digit: str) -> str:
    return f"{verb} {digit} :"


def target_digit(prompt: str) -> str | None:
    """The digit the prompt asks for, or None when the prompt is not of this task."""
    words = prompt.split()
    return words[1] if len(words) >= 2 and words[1] in DIGITS else None


def reward(prompt: str, response: str) -> float:
    """Share of the response's tokens equal to the prompt's digit, over max(len, MIN_LENGTH);
    0 for a response of more than MAX_LENGTH tokens."""
    target = target_digit(prompt)
    if target is None:
        raise ValueError(f"prompt {prompt!r} names no target digit (expected e.g. 'say 7 :')")
    tokens = response.split()
    if len(tokens) > MAX_LENGTH:
        return 0.0
    hits = sum(token == target for token in tokens)
    return hits / max(len(tokens), MIN_LENGTH)


def held_out(verb: str, digit: str) -> bool:
    """The held-out (verb, digit) pairs: 2 digits per verb, 8 different digits, so each eval
    prompt asks for a digit in a wording that training never used for it."""
    return (VERBS.index(verb) * 3 + int(digit)) % 5 == 0


def prompts(n: int = 512, seed: int = 0) -> list[str]:
    """``n`` training prompts over the 32 (verb, digit) pairs that are not held out, seeded."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        verb, digit = rng.choice(VERBS), rng.choice(DIGITS)
        if not held_out(verb, digit):
            out.append(make_prompt(verb, digit))
    return out


def eval_prompts() -> list[str]:
    """The held-out split: the 8 (verb, digit) pairs training never sees, each once."""
    return [make_prompt(v, d) for v in VERBS for d in DIGITS if held_out(v, d)]


def _sft_prompts(n: int, seed: int) -> list[str]:
    # The warm-up (which makes pi_ref) sees every pair: the held-out pairs test PPO's
    # generalisation, not whether the format was ever shown.
    rng = random.Random(seed)
    return [make_prompt(rng.choice(VERBS), rng.choice(DIGITS)) for _ in range(n)]


def sft_examples(n: int = 4096, seed: int = 1) -> list[tuple[str, str]]:
    """(prompt, response) pairs in the task's format for the warm-up pass that makes pi_ref.

    Lengths vary from 3 to MAX_LENGTH digits; the EOS after them ends the response.
    """
    rng = random.Random(seed)
    examples = []
    for prompt in _sft_prompts(n, seed):
        target = target_digit(prompt)
        assert target is not None  # _sft_prompts makes prompts of this task only
        length = rng.randint(3, MAX_LENGTH)
        digits = [target if rng.random() < SFT_TARGET_RATE else rng.choice(DIGITS) for _ in range(length)]
        examples.append((prompt, " ".join(digits)))
    return examples


def corpus() -> list[str]:
    """Every word the task uses, for training the embedded tokenizer."""
    return [" ".join(VERBS), " ".join(DIGITS), ":"]
