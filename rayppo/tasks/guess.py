"""The embedded multi-turn task: find a hidden digit from "higher" / "lower" replies.

Each episode hides a digit 0-9 (the prompt row's ``secret`` column). The policy guesses one digit
per turn; the environment answers ``higher``, ``lower`` or ends the episode when the guess is
right. A right guess earns 1, every other turn costs ``TURN_COST``: the return is
1 - TURN_COST x (turns - 1) when solved, so fewer turns is better.

The warm-up ("SFT") plays legally but aimlessly: each guess is uniform among the digits the
replies so far allow, which takes 3.4 turns on average. Bisection (always the middle of what is
left) takes 2.9, and can never take more than 4: the skill RL should find is to guess the middle.
The policy has to read the replies to do it, the whole point of a multi-turn task.
"""

from __future__ import annotations

import random
from functools import cache

DIGITS = tuple(str(d) for d in range(10))
PROMPT = "guess my digit"
"""The user's opening message of every episode."""
TURN_COST = 0.2
"""What each turn that does not solve the episode costs."""
MAX_TURNS = 6
"""The turn budget the shipped config gives an episode."""
WORDS = ("guess", "my", "digit", "higher", "lower", "say", "one", "of", "probe", "two", "three")
"""The task's words besides the digits (the ``probe`` words are for the chat-template check)."""


class HigherLower:
    """The environment of one episode (``rollout.environment = rayppo.tasks.guess:HigherLower``)."""

    def __init__(self, prompt: str, secret: int):
        self.secret = int(secret)
        if not 0 <= self.secret <= 9:
            raise ValueError(f"secret must be a digit 0-9, got {secret!r}")

    def step(self, action: str) -> tuple[str | None, float, bool]:
        words = action.split()
        if len(words) != 1 or words[0] not in DIGITS:
            return "say one digit", -TURN_COST, False
        guess = int(words[0])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), -TURN_COST, False


def conversation() -> list[dict[str, str]]:
    """The prompt of every episode, as a chat conversation."""
    return [{"role": "user", "content": PROMPT}]


def prompt_rows(n: int = 512, seed: int = 0) -> list[int]:
    """``n`` training secrets, seeded (each row's prompt is ``conversation()``)."""
    rng = random.Random(seed)
    return [rng.randrange(10) for _ in range(n)]


def eval_secrets() -> list[int]:
    """The held-out pass: every digit once (the prompt is always the same, the secret is not)."""
    return list(range(10))


def aimless_game(secret: int, rng: random.Random) -> list[tuple[str, str | None]]:
    """The warm-up's play: ``[(guess, reply or None on the right guess), ...]``, each guess uniform
    among the digits the replies so far allow."""
    low, high = 0, 9
    turns: list[tuple[str, str | None]] = []
    while True:
        guess = rng.randint(low, high)
        if guess == secret:
            return turns + [(str(guess), None)]
        reply = "higher" if guess < secret else "lower"
        turns.append((str(guess), reply))
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


def sft_games(n: int = 4096, seed: int = 1) -> list[list[tuple[str, str | None]]]:
    """``n`` warm-up games over uniformly drawn secrets."""
    rng = random.Random(seed)
    return [aimless_game(rng.randrange(10), rng) for _ in range(n)]


@cache
def expected_turns(low: int, high: int, bisect: bool) -> float:
    """Mean turns to find a secret uniform on [low, high], guessing uniformly among what is left
    (``bisect`` False, the warm-up) or always the middle (True)."""
    n = high - low + 1
    if n <= 0:
        return 0.0
    guesses = [(low + high) // 2] if bisect else list(range(low, high + 1))
    total = 0.0
    for g in guesses:
        # One turn, then the part of the range the secret is in (weighted by its size).
        rest = ((g - low) * expected_turns(low, g - 1, bisect) + (high - g) * expected_turns(g + 1, high, bisect)) / n
        total += 1 + rest
    return total / len(guesses)


def solved_return(turns: int) -> float:
    """The return of an episode solved in ``turns`` turns."""
    return 1.0 - TURN_COST * (turns - 1)
