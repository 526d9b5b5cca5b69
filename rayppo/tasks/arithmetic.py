"""A real task for a real chat model: two-digit arithmetic with a held-out split.

Each prompt is one user message ("What is 47 + 38? Reply with the number only.") and its row
carries the exact ``answer``. The verifier reads the response's final answer and scores 1.0 when
it equals ``answer``, else 0.0. The problems are ``a + b`` and ``a - b`` with two-digit operands;
a fixed tenth of all (a, op, b) triples (a hash, not a draw, so the split is the same everywhere)
is held out: training never sees a held-out problem, and ``data.prompts=arithmetic`` with
``eval`` on measures the pass rate on 128 of them (greedy and sampled; ``docs/real-model.md``).

The final answer is read the way the ecosystem's verifiers do it for integer answers (Hugging
Face's ``math-verify`` parses LaTeX and expressions too; an integer needs less): a ``\\boxed{...}``
if there is one, else the last number in the text, with thousands separators and a trailing
period ignored. "47 + 38 = 85", "The answer is **85**." and "\\boxed{85}" all answer 85; a response
that was cut before its number has none and scores 0.
"""

from __future__ import annotations

import hashlib
import random
import re

OPERATIONS = ("+",)
LOW, HIGH = 10, 99
"""Operands are two-digit numbers."""
EVAL_PROBLEMS = 128
"""Held-out problems in the ``test`` split."""
QUESTION = "What is {a} {op} {b}? Reply with the number only."

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def held_out(a: int, op: str, b: int) -> bool:
    """One problem in ten, fixed by a hash of the problem (not by a seed)."""
    return hashlib.sha256(f"{a}{op}{b}".encode()).digest()[0] % 10 == 0


def row(a: int, op: str, b: int) -> tuple[list[dict[str, str]], dict[str, str]]:
    """``(chat messages, other columns)`` of one problem."""
    return [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}], {"answer": str(solve(a, op, b))}


def _draw(rng: random.Random) -> tuple[int, str, int]:
    return rng.randint(LOW, HIGH), rng.choice(OPERATIONS), rng.randint(LOW, HIGH)


def problems(split: str = "train", n: int = 4096, seed: int = 0) -> list[tuple[int, str, int]]:
    """``n`` seeded training problems (never held out), or the ``EVAL_PROBLEMS`` held-out ones."""
    rng = random.Random(seed if split == "train" else 10_000 + seed)
    want = (n, False) if split == "train" else (EVAL_PROBLEMS, True)
    out: list[tuple[int, str, int]] = []
    while len(out) < want[0]:
        problem = _draw(rng)
        if held_out(*problem) == want[1] and (split == "train" or problem not in out):
            out.append(problem)
    return out


def final_answer(response: str) -> str | None:
    """The response's final answer as a canonical number string, or None when it has none."""
    boxed = _BOXED.findall(response)
    numbers = _NUMBER.findall(boxed[-1] if boxed else response)
    if not numbers:
        return None
    text = numbers[-1].replace(",", "")
    value = float(text)
    return str(int(value)) if value == int(value) else text


def reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the row's ``answer``, else 0.0 (the prompt is
    not read: the row carries the answer)."""
    return 1.0 if final_answer(response) == str(answer).strip() else 0.0
