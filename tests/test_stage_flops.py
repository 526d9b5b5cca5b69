"""Per-stage useful FLOPs (``plan/flops.stage_flops``) against a hand count, the ``perf/*`` figures
made of them (``run/mfu.stage_metrics``), and the matmul-rate probe (``plan/machine_rate``)."""

import subprocess
import sys

import pytest

from rayppo.models.shape import ModelShape
from rayppo.plan.flops import Sequences, StageFlops, stage_flops
from rayppo.run.mfu import stage_metrics

# One decoder layer: h = 4, 2 query heads and 1 key/value head of 2 dims, a gated MLP of width 6.
TINY = ModelShape(family="llama", hidden=4, intermediate=6, layers=1, vocab=10, heads=2, kv_heads=1, head_dim=2,
                  tied=False, qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False, labels=0,
                  max_positions=64)
SCORER = ModelShape(**{**TINY.__dict__, "labels": 1})
# Two rows: 3 prompt + 2 response tokens, and 2 prompt + 1 response token.
ROWS = Sequences([5, 3], 3)


def hand_backbone() -> int:
    """The layer's matmuls counted one by one, 2 FLOPs per multiply-add."""
    per_token = 2 * (4 * 4      # q: h -> 2 heads x 2
                     + 4 * 2    # k: h -> 1 head x 2
                     + 4 * 2    # v
                     + 4 * 4    # o: 2 heads x 2 -> h
                     + 4 * 6    # gate
                     + 4 * 6    # up
                     + 6 * 4)   # down
    assert per_token == 240
    tokens = 5 + 3
    # The token at position i attends to i positions: q.k over 4 query dims, then the weighted sum of
    # the values into 4 dims: 2 x (i x 4) multiply-adds, 2 FLOPs each.
    attention = sum(2 * 2 * i * 4 for i in (1, 2, 3, 4, 5)) + sum(2 * 2 * i * 4 for i in (1, 2, 3))
    assert attention == 240 + 96
    return per_token * tokens + attention


def test_each_stage_against_a_hand_count():
    backbone = hand_backbone()
    vocabulary_head = 2 * 4 * 10 * 3  # h x V for each of the 3 response tokens only
    score_head = 2 * 4 * 1 * 2  # h x 1 label, on each of the 2 rows' last token
    flops = stage_flops(TINY, TINY, SCORER, None, ROWS, epochs=1, minibatches=1)
    assert flops.generate == backbone + vocabulary_head == 2496
    assert flops.reference == backbone + vocabulary_head
    assert flops.reward == backbone + score_head == 2272
    assert flops.learn == 3 * (backbone + vocabulary_head)  # no critic: the policy's forward + backward (2x)
    two_epochs = stage_flops(TINY, TINY, SCORER, None, ROWS, epochs=2, minibatches=1)
    assert two_epochs.learn == 2 * flops.learn and two_epochs.generate == flops.generate


def test_a_stage_without_its_model_counts_nothing():
    flops = stage_flops(TINY, None, None, None, ROWS, epochs=1, minibatches=1)
    assert flops.reference == 0 and flops.reward == 0 and flops.generate > 0 and flops.learn > 0


def test_stage_metrics_from_given_numbers():
    flops = StageFlops(generate=2e12, reference=0.0, reward=1e12, learn=6e12)
    seconds = {"time/generate": 2.0, "time/reference": 0.0, "time/reward": 0.5, "time/learn": 3.0, "time/sync": 1.0}
    tokens = {"generate": 300, "reference": 800, "reward": 800, "learn": 800}
    out = stage_metrics(flops, seconds, 4e12, tokens)
    assert out == pytest.approx({
        "perf/tflops/generate": 1.0, "perf/mfu/generate": 0.25, "perf/tokens_per_s/generate": 150.0,
        "perf/tflops/reward": 2.0, "perf/mfu/reward": 0.5, "perf/tokens_per_s/reward": 1600.0,
        "perf/tflops/learn": 2.0, "perf/mfu/learn": 0.5, "perf/tokens_per_s/learn": 800 / 3})
    # No reference ran (its time is 0): nothing of it. No rate measured: no MFU, the rest stays.
    unmeasured = stage_metrics(flops, seconds, None, tokens)
    assert not any(k.startswith("perf/mfu/") for k in unmeasured)
    assert unmeasured["perf/tflops/learn"] == pytest.approx(2.0)


PROBE = """
import math, torch
from rayppo.plan.machine_rate import matmul_flops_per_s, peak_rate
torch.set_num_threads(2)
seen = []
mm = torch.mm
torch.mm = lambda a, b: (seen.append(torch.get_num_threads()), mm(a, b))[1]
rate = matmul_flops_per_s(64, 32, 48, "float32", threads=1, repeats=3)
assert rate > 0 and math.isfinite(rate), rate
assert seen == [1] * 4, seen  # the warm-up and 3 timed calls, all on 1 thread
assert torch.get_num_threads() == 2  # restored
assert 0 < peak_rate("bfloat16", 1, hidden=32, intermediate=48, tokens=16, repeats=2) < math.inf
print("ok")
"""


def test_the_probe_gives_a_positive_rate_on_the_threads_it_was_given():
    # A fresh interpreter: once an in-process vLLM CPU engine has bound this process's threads (other
    # tests), vLLM turns torch.set_num_threads into a no-op ("doesn't allow ... after the thread binding").
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
