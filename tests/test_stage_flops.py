"""Per-stage useful FLOPs (``plan/flops.stage_flops``) against a hand count, the ``perf/*`` figures
made of them (``run/mfu.stage_metrics``), and the matmul-rate probe (``rayppo/machine/matmul_rate``)."""

import itertools
import subprocess
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rayppo.config.load import load_config
from rayppo.data.rollout import Rollout
from rayppo.machine import matmul_rate
from rayppo.machine.matmul_rate import Probe, matmul_flops, matmul_flops_per_s, peak_rate
from rayppo.models.shape import ModelShape
from rayppo.plan.flops import LearnPasses, Sequences, StageFlops, learn_flops, stage_flops
from rayppo.run.mfu import StageCounter, rollout_sequences, stage_metrics

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
    flops = stage_flops(TINY, TINY, SCORER, None, ROWS, LearnPasses(epochs=1, minibatches=1))
    assert flops.generate == backbone + vocabulary_head == 2496
    assert flops.reference == backbone + vocabulary_head
    assert flops.reward == backbone + score_head == 2272
    assert flops.learn == 3 * (backbone + vocabulary_head)  # no critic: the policy's forward + backward (2x)
    two_epochs = stage_flops(TINY, TINY, SCORER, None, ROWS, LearnPasses(epochs=2, minibatches=1))
    assert two_epochs.learn == 2 * flops.learn and two_epochs.generate == flops.generate


def test_a_prompt_another_row_has_counts_once():
    """Two samples of one 3-token prompt (2 and 1 response tokens) and a 2-token prompt with 1: the
    second sample's prompt positions are the first's numbers again (causal attention), so only its
    response position counts, still attending to all 4 positions. Counted per row, a stage whose
    pass computes the prompt once (vLLM's prefix cache, models/shared_prompts.py) did more useful
    work than it ran, and its MFU could pass 1."""
    rollout = Rollout([[1, 2, 3], [1, 2, 3], [4, 5]], [[6, 7], [8], [9]], [[0.0] * 2, [0.0], [0.0]],
                      ["stop"] * 3, ["a", "a", "b"], ["", "", ""])
    seq = rollout_sequences(rollout)
    assert (seq.lengths, seq.response_tokens, seq.repeated_prompts) == ([5, 4, 3], 4, [3])
    tokens = 5 + 1 + 3  # the second row: its response position only
    attention = sum(2 * 2 * i * 4 for i in (1, 2, 3, 4, 5)) + 2 * 2 * 4 * 4 + sum(2 * 2 * i * 4 for i in (1, 2, 3))
    backbone = 240 * tokens + attention  # 240: hand_backbone's FLOPs per token
    assert backbone == 2560
    head = 2 * 4 * 10 * 4  # h x V for each of the 4 response tokens
    flops = stage_flops(TINY, TINY, SCORER, TINY, seq, LearnPasses(epochs=1, minibatches=1))
    assert flops.generate == flops.reference == backbone + head
    assert flops.reward == backbone + 2 * 4 * 1 * 3  # the score head on each row's last token
    critic = backbone + 2 * 4 * tokens  # the value head on every position counted
    assert flops.learn == learn_flops(TINY, TINY, seq, LearnPasses(1, 1)) == critic + 3 * (backbone + head + critic) - critic


def test_a_lora_policys_backward_takes_no_weight_gradient(embedded_dir):
    """LoRA (``learner.lora_rank``): the frozen weights get no gradient, so the backward is the
    input's gradient: one more pass through each projection and the head, none through the first
    layer's q, k, v (their input, the embedding's output, is frozen); attention's backward is
    still two passes (QK^T and AV have two inputs and no weights). Counted as a full backward, a
    LoRA learner's MFU passed 1 (docs/lora.md)."""
    backbone, head = hand_backbone(), 2 * 4 * 10 * 3
    projections = 240 * (5 + 3)
    attention = backbone - projections
    first_qkv = 2 * (4 * 4 + 4 * 2 + 4 * 2) * (5 + 3)  # TINY's one layer is the first
    flops = stage_flops(TINY, TINY, SCORER, None, ROWS, LearnPasses(epochs=1, minibatches=1, lora=True))
    assert flops.learn == (backbone + head) + (projections - first_qkv + head) + 2 * attention == 4816
    assert stage_flops(TINY, TINY, SCORER, None, ROWS, LearnPasses(epochs=1, minibatches=1)).learn == 3 * (backbone + head)
    assert StageCounter.of(load_config(None, ["learner.lora_rank=4"])).lora
    assert not StageCounter.of(load_config(None, [])).lora


def test_a_stage_without_its_model_counts_nothing():
    flops = stage_flops(TINY, None, None, None, ROWS, LearnPasses(epochs=1, minibatches=1))
    assert flops.reference == 0 and flops.reward == 0 and flops.generate > 0 and flops.learn > 0


def test_the_teachers_pass_counts_as_the_reference_forward_of_its_own_model(digits_teacher):
    """With ``distill.teacher`` the counter reads the teacher's shape and counts its pass as the
    reference forward (``reference_flops``) of that model; without a teacher it counts nothing."""
    from rayppo.models.shape import read_shape
    from rayppo.models.teacher import teacher_folder
    from rayppo.plan.flops import reference_flops
    from rayppo.run.stage_times import StageTimes

    counter = StageCounter.of(load_config(None, [f"distill.teacher={digits_teacher}"]))
    teacher = read_shape(teacher_folder(str(digits_teacher)))
    assert counter.teacher == teacher
    assert counter.flops(ROWS).teacher == reference_flops(teacher, ROWS) > 0
    assert StageCounter.of(load_config(None, [])).flops(ROWS).teacher == 0
    rollout = Rollout(prompt_ids=[[1, 2, 3], [4, 5]], response_ids=[[6, 7], [8]], logprobs=[[-1.0, -1.0], [-1.0]],
                      finish_reason=["stop", "stop"], prompt_text=["abc", "de"], response_text=["fg", "h"])
    counter.rate = 1e9
    times = StageTimes(generate=1.0, reference=0.0, reward=0.5, learn=2.0, sync=0.1, iteration=4.0, teacher=0.25)
    figures = counter.metrics(rollout, times)
    assert figures["perf/mfu/teacher"] == pytest.approx(reference_flops(teacher, ROWS) / 0.25 / 1e9)
    assert figures["perf/tokens_per_s/teacher"] == pytest.approx(8 / 0.25)


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
from rayppo.machine.matmul_rate import Probe, matmul_flops_per_s, peak_rate
torch.set_num_threads(2)
seen = []
mm = torch.mm
torch.mm = lambda a, b: (seen.append(torch.get_num_threads()), mm(a, b))[1]
rate = matmul_flops_per_s(64, 32, 48, Probe("float32", threads=1, repeats=3))
assert rate > 0 and math.isfinite(rate), rate
assert seen == [1] * 4, seen  # the warm-up and 3 timed calls, all on 1 thread
assert torch.get_num_threads() == 2  # restored
assert 0 < peak_rate("bfloat16", 1, hidden=32, intermediate=48, tokens=16) < math.inf
print("ok")
"""


def test_the_probe_gives_a_positive_rate_on_the_threads_it_was_given():
    # A fresh interpreter: once an in-process vLLM CPU engine has bound this process's threads (other
    # tests), vLLM turns torch.set_num_threads into a no-op ("doesn't allow ... after the thread binding").
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_probe_counts_the_flops_of_the_matmul_it_times(monkeypatch):
    """The probe's numerator against a hand count: [3, 4] x [4, 5] is 3 x 5 outputs of 4
    multiply-adds, 2 FLOPs each: 120. torch's own counter sees exactly that in each of the probe's
    calls (the warm-up and 3 timed). On a clock whose timed calls last 0.5, 0.25 and 1 s the rate
    is that count over the fastest, exactly 120 / 0.25 (the machine's peak: over the median, 0.5 s,
    a stage as fast as the probe's best call would have an MFU of 2). ``peak_rate`` times
    ``tokens`` x ``hidden`` x ``intermediate`` (at least one token)."""
    hand = 3 * 5 * (4 * 2)
    assert matmul_flops(3, 4, 5) == hand == 120
    readings = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # each timed call reads the clock before and after
    monkeypatch.setattr(matmul_rate, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    threads = torch.get_num_threads()
    with FlopCounterMode(display=False) as counter:
        rate = matmul_flops_per_s(3, 4, 5, Probe("float32", threads, repeats=3))
    assert counter.get_total_flops() == 4 * hand
    assert rate == hand / 0.25 == 480.0
    clock = itertools.count(0.0, 0.5)  # every call 0.5 s
    monkeypatch.setattr(matmul_rate, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert peak_rate("float32", threads, hidden=4, intermediate=5, tokens=3) == 240.0
    assert peak_rate("float32", threads, hidden=4, intermediate=5, tokens=0) == 2 * 1 * 4 * 5 / 0.5


def test_the_probe_refuses_a_thread_count_torch_ignores(monkeypatch):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it has bound the
    process's threads (``vllm/v1/worker/cpu_worker.py``, as done here): a probe asked for more
    threads would time fewer, and every stage's MFU would be inflated by the ratio. It says so."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with pytest.raises(RuntimeError, match=rf"asked torch for {threads + 1} threads and has {threads}"):
        matmul_flops_per_s(8, 8, 8, Probe("float32", threads + 1, repeats=1))
