"""Rows cut by token budget: micro-batches of about equal padded size, and ranks of equal tokens.

A forward pass over rows of ragged length costs what its padded rectangle holds: rows x (the
longest prompt + the longest response) under the ``[left-padded prompt | right-padded response]``
layout of ``models/sequences.py``. Rows sorted by length and cut into passes of like lengths within
a token budget keep that waste small (veRL's dynamic batch size, OpenRLHF's
``--micro_train_batch_size`` by tokens, NeMo-RL's dynamic batching do the same). Pure Python: the
learner, the reference and the reward scorer all call it, so their passes agree on what they cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

PASS_OVERHEAD_TOKENS = 256
"""What one more forward/backward pass costs beyond its tokens, counted in tokens (the layers'
fixed work per call: launches, Python, the optimiser hooks). Cutting rows of like length apart
saves padding but adds passes; ``token_batches`` weighs one against the other with this."""

LAYOUTS = ("padded", "right_padded", "packed")
"""How a pass lays out its rows (``token_batches``): what its token count is."""

_EXACT_ROWS = 1024
"""Rows up to which the cut is the exact optimum (the search is rows x rows-per-pass); longer
sorted lists are cut in runs of this many."""


def token_batches(prompt_lengths: Sequence[int], response_lengths: Sequence[int], budget: int,
                  layout: str = "padded") -> list[list[int]]:
    """Indices of the rows in micro-batches of at most ``budget`` padded tokens each.

    Rows are sorted longest first (prompt + response; ties in row order, so the cut is
    deterministic) and cut into consecutive runs that minimise the tokens processed, padding
    included, plus ``PASS_OVERHEAD_TOKENS`` per pass: a run of rows x (longest prompt + longest
    response) within the budget. So short rows are not padded to a long row's width merely because
    the budget had room, and long rows are not run one at a time. A row longer than the budget is a
    micro-batch of its own. ``budget`` 0: one batch of every row, in row order (the unbucketed pass).

    ``layout`` says what a pass's rectangle is: ``padded``, rows x (longest prompt + longest
    response) as above; ``right_padded``, each sequence from column 0, rows x the longest
    sequence; ``packed``, padding-free (``models/packing.py``): a pass costs its real tokens and
    fewer passes are cheaper, so rows sorted as above fill each pass up to ``budget`` real tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    n = len(prompt_lengths)
    if len(response_lengths) != n:
        raise ValueError(f"{n} prompt lengths but {len(response_lengths)} response lengths")
    if budget <= 0 or n == 0:
        return [list(range(n))] if n else []
    order = sorted(range(n), key=lambda i: (-(prompt_lengths[i] + response_lengths[i]), i))
    if layout == "packed":
        return _filled(order, [prompt_lengths[i] + max(response_lengths[i], 1) for i in range(n)], budget)
    # right_padded: one width per row, the whole sequence (a prompt of 0 and a response of p + r)
    joint = layout == "right_padded"
    prompt = [0 if joint else p for p in prompt_lengths]
    response = [max(r, 1) + (p if joint else 0) for p, r in zip(prompt_lengths, response_lengths)]
    batches: list[list[int]] = []
    for start in range(0, n, _EXACT_ROWS):
        run = order[start : start + _EXACT_ROWS]
        cuts = _best_cuts([prompt[i] for i in run], [response[i] for i in run], budget)
        batches += [run[a:b] for a, b in zip(cuts, cuts[1:])]
    return batches


def _filled(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """``order`` cut into consecutive runs of at most ``budget`` tokens (a longer row alone)."""
    batches: list[list[int]] = [[]]
    used = 0
    for i in order:
        if batches[-1] and used + lengths[i] > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += lengths[i]
    return batches


def _best_cuts(prompt: list[int], response: list[int], budget: int) -> list[int]:
    """Boundaries ``0 = c_0 < ... < c_k = n`` of the cheapest split of sorted rows into runs
    (dynamic programming over the run's start: cost[j] = min_i cost[i] + padded(i..j) + overhead)."""
    n = len(prompt)
    cost = [0.0] + [float("inf")] * n
    previous = [0] * (n + 1)
    for i in range(n):
        width_p = width_r = 0
        for j in range(i, n):
            width_p, width_r = max(width_p, prompt[j]), max(width_r, response[j])
            padded = (j - i + 1) * (width_p + width_r)
            if padded > budget and j > i:
                break
            if cost[i] + padded + PASS_OVERHEAD_TOKENS < cost[j + 1]:
                cost[j + 1], previous[j + 1] = cost[i] + padded + PASS_OVERHEAD_TOKENS, i
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(previous[cuts[-1]])
    return cuts[::-1]


def scoring_batches(prompt_lengths: Sequence[int], response_lengths: Sequence[int], budget: int,
                    rows_per_batch: int, layout: str = "padded") -> list[list[int]]:
    """The forward passes of a scorer (reference, reward model): ``token_batches`` of ``budget``
    for passes laid out as ``layout``, or with ``budget`` 0 runs of ``rows_per_batch`` consecutive rows."""
    if budget > 0:
        return token_batches(prompt_lengths, response_lengths, budget, layout)
    n = len(prompt_lengths)
    return [list(range(start, min(start + rows_per_batch, n))) for start in range(0, n, rows_per_batch)]


def padded_tokens(prompt_lengths: Sequence[int], response_lengths: Sequence[int], batches: list[list[int]]) -> int:
    """Tokens the forward passes over ``batches`` process, padding included."""
    return sum(len(b) * (max(prompt_lengths[i] for i in b) + max(max(response_lengths[i] for i in b), 1))
               for b in batches if b)


def balanced_parts(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``weights`` dealt into ``parts`` parts of about equal total weight.

    Longest-processing-time first: heaviest item to the lightest part (ties: the lower part),
    within 4/3 of the best split. Each part's indices ascend. With ``len(weights) >= parts``
    every part gets at least one item.
    """
    loads = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(loads)
        out[p].append(i)
        heapq.heappush(loads, (load + weights[i], p))
    return [sorted(part) for part in out]


def balanced_shards(lengths: Sequence[int], minibatches: Sequence[Sequence[int]], ranks: int) -> list[list[int]]:
    """Global rows each learner rank owns: every minibatch's rows dealt to the ranks by tokens
    (``lengths``: prompt + response of each row), so every rank processes about the same tokens of
    every minibatch (of the first epoch; later epochs reshuffle, balanced in expectation).

    A minibatch with fewer rows than ranks leaves some ranks none of it; a rank left with no row
    at all is not allowed (the caller splits by rows instead)."""
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for rows in minibatches:
        rows = list(rows)
        for rank, part in enumerate(balanced_parts([lengths[i] for i in rows], ranks)):
            owned[rank].extend(rows[i] for i in part)
    return [sorted(rows) for rows in owned]
