"""The learner stage alone: one PPO update of a workload's shape, timed part by part.

    python benchmarks/learner_step.py --workload small [section.field=value ...]

One learner rank in this process (DeepSpeed, the workload's dtype and ZeRO stage, ``--threads``
torch threads), on a rollout
of the workload's shape with random tokens (prompts of 4-11 tokens, responses of the full
``rollout.max_new_tokens``). A first update warms up; the second is measured: its time, split
into the experience pass (critic values, GAE), the policy's and the critic's forward and backward
passes and the optimiser steps; its useful GFLOP/s (``rayppo.plan.flops``) against a matmul of the size
the learner runs most, on the same threads (``learn_efficiency``); and the process's peak RSS.
Prints one JSON line. Use it to measure a change to the learner before the whole ``rayppo bench``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _timed, load_workloads, matmul_gflop_per_s, prepare_models, workload_config  # noqa: E402

from rayppo.config.derived import batch_rows, has_critic  # noqa: E402
from rayppo.data.rollout import Rollout  # noqa: E402
from rayppo.models.shape import read_shape  # noqa: E402
from rayppo.plan.flops import LearnPasses, learn_flops  # noqa: E402
from rayppo.run.mfu import rollout_sequences  # noqa: E402


def long_tail_lengths(n: int, max_tokens: int, mean: float = 34.0, seed: int = 0) -> list[int]:
    """``n`` response lengths of a geometric law of ``mean`` cut at ``max_tokens``: the shape of a
    reasoning batch (on ``small``, 128: mean ~33, p50 ~24, p90 ~77, a few rows at the limit)."""
    draw = random.Random(seed)
    return [min(max_tokens, 1 + int(draw.expovariate(1 / (mean - 1)))) for _ in range(n)]


def random_rollout(batch_size: int, response_tokens: int | list[int], vocab: int, seed: int = 0,
                   group: int = 1, prompt_tokens: tuple[int, int] = (4, 11)) -> Rollout:
    """``batch_size`` rows of random prompt (``prompt_tokens`` = (fewest, most) tokens) and response
    tokens (``response_tokens`` each, or row by row from a list); log-probs set; rows in groups of
    ``group`` consecutive ones (``Rollout.group_id``) that share their prompt, as GRPO's do."""
    g = torch.Generator().manual_seed(seed)
    lengths = response_tokens if isinstance(response_tokens, list) else [response_tokens] * batch_size
    low, high = prompt_tokens
    shared = [torch.randint(3, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
              for _ in range(-(-batch_size // group))]
    prompts = [shared[i // group][:] for i in range(batch_size)]
    responses = [torch.randint(3, vocab, (t,), generator=g).tolist() for t in lengths]
    logprobs = [[-9.0] * t for t in lengths]
    n = batch_size
    reasons = ["length" if t == max(lengths) else "stop" for t in lengths]
    return Rollout(prompts, responses, logprobs, reasons, [""] * n, [""] * n, [0] * n, [0] * n,
                   [i // group for i in range(n)], [row[:] for row in logprobs], torch.rand(n, generator=g).tolist())


def _timing_hooks(parts: dict[str, float], calls: dict[str, int]) -> None:
    """Accumulate the seconds of each part of ``LearnerEngine.train`` into ``parts``, and how many
    times each ran into ``calls`` (the policy's forward runs once per micro-batch: the passes)."""
    import rayppo.learner.learner_engine as engine
    import rayppo.learner.step as step
    import rayppo.learner.update as update

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - start
                calls[name] += 1
        return wrapper

    update.policy_pass = timed("policy forward", update.policy_pass)  # ppo_update's: one per micro-batch
    update.policy_objective = timed("policy loss", update.policy_objective)
    update.value_objective = timed("critic forward", update.value_objective)
    step.make_experience = timed("experience pass", step.make_experience)  # the learn step's call
    learner_engine: Any = engine.LearnerEngine  # a method replaced by a timed one: not a type the checker follows
    steps = learner_engine._steps
    learner_engine._steps = lambda self: update.OptimiserSteps(
        *(fn and timed(name, fn) for name, fn in zip(("policy backward", "critic backward", "optimiser steps", "learning rate"),
                                                     vars(steps(self)).values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--lengths", default="fixed", help="response lengths: fixed (rollout.max_new_tokens each), "
                        "long-tail (geometric, mean 34, cut at max_new_tokens) or fixed:N (N each)")
    parser.add_argument("--pass-overhead-tokens", type=int,
                        help="the token-budget cut's price of one more pass, in tokens (rayppo's "
                             "data/micro_batches.py PASS_OVERHEAD_TOKENS; default: its value)")
    parser.add_argument("--prompt-tokens", default="4-11", metavar="LOW-HIGH",
                        help="prompt lengths, drawn per group (default 4-11; the arithmetic prompts in "
                             "SmolLM2's chat template: 44-50)")
    parser.add_argument("overrides", nargs="*", help="section.field=value config overrides")
    args = parser.parse_args()
    import rayppo.data.micro_batches as micro_batches

    if args.pass_overhead_tokens is not None:  # the learner rank runs in this process
        micro_batches.PASS_OVERHEAD_TOKENS = args.pass_overhead_tokens
    from rayppo.cluster.learner_group import LearnerGroup

    w = load_workloads()[args.workload]
    policy, reward_model = prepare_models(w)
    cfg = workload_config(w, policy, reward_model, ["learner.num_ranks=1"] + args.overrides)
    cfg.checks.max_logprob_mismatch = cfg.checks.max_logprob_kl = float("inf")  # random tokens: only the time counts
    torch.set_num_threads(args.threads)
    shape = read_shape(policy)
    rows, limit = batch_rows(cfg), cfg.rollout.max_new_tokens
    lengths = (long_tail_lengths(rows, limit) if args.lengths == "long-tail"
               else int(args.lengths.split(":")[1]) if args.lengths.startswith("fixed:") else limit)
    low, high = (int(x) for x in args.prompt_tokens.split("-"))
    rollout = random_rollout(rows, lengths, shape.vocab, group=cfg.rollout.samples_per_prompt, prompt_tokens=(low, high))
    parts: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    _timing_hooks(parts, calls)
    learner = LearnerGroup(cfg, placement=None)
    learner.train(rollout, cfg.ppo.kl_coef, 0)
    parts.clear()
    calls.clear()
    rollout.policy_version = [1] * len(rollout)
    seconds, _ = _timed(learner.train, rollout, cfg.ppo.kl_coef, 1)
    seq = rollout_sequences(rollout)
    critic = read_shape(cfg.model.critic or policy) if has_critic(cfg.ppo) else None
    flops = learn_flops(shape, critic, seq, LearnPasses(cfg.ppo.epochs, cfg.ppo.minibatches,
                                                        lora=cfg.learner.lora_rank > 0))
    matmul = matmul_gflop_per_s(sum(seq.lengths) // cfg.ppo.minibatches, shape.hidden, shape.intermediate,
                                cfg.model.dtype, args.threads)
    real = sum(len(r) for r in rollout.response_ids)
    print(json.dumps({"workload": w.name, "advantage": cfg.ppo.advantage, "rows": len(rollout),
                      "lengths": args.lengths, "response_tokens": real, "s_per_1k_response_tokens":
                      round(1000 * seconds / real, 4), "micro_batch_tokens": cfg.learner.micro_batch_tokens,
                      "packing": cfg.learner.packing, "pass_overhead_tokens": micro_batches.PASS_OVERHEAD_TOKENS,
                      "threads": torch.get_num_threads(), "learn_s": round(seconds, 2),
                      "parts_s": {k: round(v, 2) for k, v in parts.items()}, "passes": calls["policy forward"],
                      "zero_stage": cfg.learner.zero_stage, "learn_gflop": round(flops / 1e9),
                      "learn_gflop_per_s": round(flops / seconds / 1e9, 1), "matmul_gflop_per_s": round(matmul, 1),
                      "learn_efficiency": round(flops / seconds / 1e9 / matmul, 3),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


if __name__ == "__main__":
    main()
