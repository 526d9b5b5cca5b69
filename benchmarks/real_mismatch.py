"""The generator-vs-learner log-prob gap on the real model, per dtype and head precision.

SmolLM2-135M-Instruct (``model.policy=smollm2-135m-instruct``) samples responses to the
arithmetic task's prompts in a real vLLM engine (CPU build, the generator rayppo runs); the
learner's forward (``models/sequences.policy_forward`` with the chunked fp32 head, or the same
hidden states through the head in the model's dtype: the learner before its fp32 head) recomputes
their log-probs at the same weights. Per token, over every response token:
mean, p99 and max of |log mu - log pi|, and the k3 estimate of KL(mu || pi) per token (the guard's
statistic, ``learner/guard.py``). Rows:

- ``float32``: both sides in fp32 (the head's precision is moot);
- ``bfloat16, bf16 head``: vLLM's default head and the learner's old one;
- ``bfloat16, fp32 head``: both heads in fp32 (rayppo now).

    python benchmarks/real_mismatch.py --prompts 64 --samples 4 --out benchmarks/results/real_mismatch.json

A perturbed weight (``--faults``: one MLP matrix moved by 1% of its RMS on the generator's side)
and a sampling temperature the learner does not know (0.9 for a learner at 1.0) show what the guard
has to catch, beside the healthy rows.

``--spread``: the guard's per-generator figure when each generator holds few tokens. The responses
are cut into consecutive "generators" of ``--generator-rows`` rows (one prompt's group of 4: ~100
tokens, the fewest a generator has in a checked minibatch), and each one's k3 mean is computed as
the guard computes it (``guard.generator_kl``, each token capped at half the limit): its mean,
spread and largest value on healthy bf16, and its smallest at the temperature gap, against
``checks.max_logprob_kl``. The limit is sound when the healthy largest sits far under it and the
gap's smallest above it.

    python benchmarks/real_mismatch.py --spread --prompts 64 --samples 4 --out benchmarks/results/real_mismatch_spread.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from head_mismatch import learner_logprobs

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.config.derived import kl_limit
from rayppo.config.system import ChecksConfig
from rayppo.data.prompts import load_prompt_set
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.sequences import pack


def gap_table(behaviour: list[list[float]], learner: torch.Tensor, mask: torch.Tensor,
              generator_rows: int = 0, limit: float = 1e-2) -> dict[str, float]:
    """mean / p99 / max of |log mu - log pi| and mean k3 over the valid tokens; also the largest
    row mean of k3 (the guard's per-row view), and with ``generator_rows`` the per-generator spread
    (``generator_spread``)."""
    mu = torch.zeros_like(learner)
    for i, row in enumerate(behaviour):
        mu[i, : len(row)] = torch.tensor(row, dtype=learner.dtype)
    valid = mask.bool()
    per_token = (learner - mu).double() * mask  # log pi - log mu, 0 on padding
    log_ratio = per_token[valid]
    gap = log_ratio.abs()
    k3 = torch.expm1(log_ratio) - log_ratio
    row_mean = (per_token.sum(1) / mask.sum(1).clamp(min=1)).abs()  # |log| of each row's geometric-mean ratio
    spread = generator_spread(per_token, mask, generator_rows, limit) if generator_rows else {}
    return {"mean": float(gap.mean()), "p99": float(gap.quantile(0.99)), "max": float(gap.max()),
            "k3_mean": float(k3.mean()), "tokens": int(valid.sum()),
            "row_geo_p99": float(row_mean.quantile(0.99)), "row_geo_max": float(row_mean.max()), **spread}


def generator_spread(per_token: torch.Tensor, mask: torch.Tensor, rows: int, limit: float) -> dict[str, float]:
    """The guard's k3 mean of each run of ``rows`` consecutive responses as one generator's
    (``guard.generator_kl`` with ``limit``): mean, standard deviation, min, max, and how many of
    them exceed the limit."""
    from rayppo.learner.collective import LocalCollective
    from rayppo.learner.guard import generator_kl

    ids = torch.arange(per_token.shape[0]) // rows
    kl = generator_kl(per_token, mask.double(), ids, LocalCollective(), limit)
    tokens = torch.zeros(int(ids.max()) + 1, dtype=torch.float64).index_add(0, ids, mask.double().sum(1))
    return {"generator_rows": rows, "generators": len(kl), "generator_tokens_mean": float(tokens.mean()),
            "generator_tokens_min": float(tokens.min()), "generator_kl_mean": float(kl.mean()),
            "generator_kl_std": float(kl.std()), "generator_kl_min": float(kl.min()),
            "generator_kl_max": float(kl.max()), "generators_over_limit": int((kl > limit).sum()), "limit": limit}


def measure(dtype: str, head_fp32: bool, prompts: int, samples: int, new_tokens: int, perturb: bool,
            generator_temperature: float | None, generator_rows: int = 0) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = str(resolve_model_path("smollm2-135m-instruct"))
    tokenizer = load_tokenizer(path)
    batch = load_prompt_set("arithmetic", "prompt", tokenizer, 256).select(range(prompts)).groups_of(samples)
    start = time.perf_counter()
    generator = GeneratorEngine(path, SamplingSettings(max_new_tokens=new_tokens,
                                                       temperature=generator_temperature or 1.0),
                                backend="vllm", dtype=dtype,
                                actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1, head_fp32=head_fp32)))
    model = load_causal_lm(path, dtype).eval()
    if perturb:  # the generator holds one tensor the learner does not
        name = "model.layers.10.mlp.down_proj.weight"
        weight = dict(model.named_parameters())[name].detach().float()
        moved = weight + 0.01 * weight.square().mean().sqrt() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        generator.backend.load_weights({name: moved.to(weight.dtype if dtype == "float32" else torch.bfloat16)})
    rollout = generator.generate(batch, seed=0)
    packed = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id)
    learner = learner_logprobs(model, packed, 1.0, head_fp32)
    del generator
    return {"dtype": dtype, "head_fp32": head_fp32, "perturbed": perturb,
            "generator_temperature": generator_temperature, "responses": len(rollout.response_ids),
            "seconds": time.perf_counter() - start,
            **gap_table(rollout.logprobs, learner, packed.mask, generator_rows, kl_limit(ChecksConfig(), dtype))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--faults", action="store_true", help="also the perturbed-weight and temperature rows")
    parser.add_argument("--only-bf16", action="store_true", help="only the bf16 row with the fp32 head")
    parser.add_argument("--spread", action="store_true",
                        help="only healthy bf16 and the temperature gap, with the per-generator spread")
    parser.add_argument("--generator-rows", type=int, default=4, help="rows per generator for --spread")
    parser.add_argument("--out", help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    # (dtype, fp32 head, perturbed weights, the generator's temperature; None: the learner's)
    cases: list[tuple[str, bool, bool, float | None]] = [("float32", True, False, None), ("bfloat16", False, False, None),
                                                         ("bfloat16", True, False, None)]
    if args.only_bf16:
        cases = cases[2:]
    if args.spread:
        cases = [("bfloat16", True, False, None), ("bfloat16", True, False, 0.9)]
    if args.faults:
        cases += [("bfloat16", True, True, None), ("bfloat16", True, False, 0.9), ("float32", True, True, None)]
    rows = []
    for dtype, head, perturb, temperature in cases:
        row = measure(dtype, head, args.prompts, args.samples, args.new_tokens, perturb, temperature,
                      args.generator_rows if args.spread else 0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
