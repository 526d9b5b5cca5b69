"""Sample responses of an iteration: the record the terminal, the metrics log and the trackers
show, which ones are picked, and how they fit a terminal line."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One completion shown to the user: the prompt, the policy's response and its reward."""

    prompt: str
    response: str
    reward: float


def pick_samples(prompts: Sequence[str], responses: Sequence[str], rewards: Sequence[float], n: int) -> list[Sample]:
    """``n`` completions spread over the batch's rewards, highest first: the highest and the
    lowest, the rest evenly spaced between them in reward order (n=3: highest, median, lowest;
    n=1: the median). Ties keep batch order, NaN rewards rank lowest: the same batch always gives
    the same samples."""
    if not len(prompts) == len(responses) == len(rewards):
        raise ValueError(f"pick_samples: {len(prompts)} prompts, {len(responses)} responses, {len(rewards)} rewards")
    ranked = sorted(range(len(rewards)), key=lambda i: (-_rank_value(rewards[i]), i))
    m, n = len(ranked), min(n, len(ranked))
    if n <= 0:
        return []
    if n == 1:  # the middle, rounded as below: the lower median of an even batch
        positions = [m // 2]
    else:  # k * (m - 1) / (n - 1), rounded half up: n <= m keeps the positions distinct
        positions = [(2 * k * (m - 1) + n - 1) // (2 * (n - 1)) for k in range(n)]
    return [Sample(prompts[i], responses[i], float(rewards[i])) for i in (ranked[p] for p in positions)]


def shown_prompt(text: str, messages: list[dict[str, Any]] | None) -> str:
    """A prompt as a terminal line shows it: a conversation by its last user message (rendered
    whole, its system prompt and template tokens fill the line and the question is cut out)."""
    asked = [m.get("content") for m in messages or [] if m.get("role") == "user"]
    return asked[-1] if asked and isinstance(asked[-1], str) else text


def _rank_value(reward: float) -> float:
    return -math.inf if math.isnan(reward) else reward


def format_samples(samples: Sequence[Sample], width: int = 100) -> list[str]:
    """Two terminal lines per sample, each at most ``width`` columns::

        reward  0.750  say 7 :
                    -> 7 7 3 7 7

    Line breaks show as ``⏎``, tabs as spaces; text that does not fit keeps its start and end
    around a ``…``."""
    lines = []
    for s in samples:
        head = f"reward {s.reward:>6.3f}  "
        lines.append(head + _fit(s.prompt, width - _columns(head)))
        arrow = " " * (len(head) - 3) + "-> "
        lines.append(arrow + _fit(s.response, width - len(arrow)))
    return lines


def _one_line(text: str) -> str:
    """Line breaks as ``⏎``, tabs as spaces, other control characters as ``�``."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "⏎").replace("\t", " ")
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" else c for c in text)


def _columns(text: str) -> int:
    """Terminal columns of ``text``: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _fit(text: str, width: int) -> str:
    """``text`` on one line within ``width`` columns: start and end kept around a ``…``."""
    text, width = _one_line(text), max(width, 5)
    if _columns(text) <= width:
        return text
    room = width - 1
    head, tail = _prefix_within(text, room - room // 3), _prefix_within(text[::-1], room // 3)[::-1]
    return head + "…" + tail


def _prefix_within(text: str, width: int) -> str:
    used = 0
    for i, c in enumerate(text):
        used += _columns(c)
        if used > width:
            return text[:i]
    return text

