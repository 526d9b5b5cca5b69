"""How much of one small update a bf16 copy of the weights keeps: the distillation student's first steps.

The student (SmolLM2-135M-Instruct, shipped in bf16, so its weights start on the bf16 grid) samples
a batch of arithmetic answers; the teacher (``--teacher RUN``, the GRPO recipe's run) scores them
with its top-k (``distill.topk``). Then S AdamW steps (lr, clip 1.0, as the distillation recipe)
lower the top-k reverse KL on that batch, from the same start, with three ways of holding the weights:

- ``fp32``: fp32 weights, fp32 compute;
- ``bf16 weights, fp32 masters``: rayppo's learner at ``model.dtype=bfloat16`` (DeepSpeed's bf16
  mode): the optimiser steps fp32 master copies, and the module the forward runs (and the
  generators serve) holds their rounding to bf16;
- ``fp32 weights, bf16 autocast``: TRL's ``bf16=True`` (transformers' Trainer): fp32 weights, each
  matmul's operands cast to bf16 per call, embeddings and norms read in fp32.

After each step it reports the batch's mean KL under the weights the next forward uses, and the
share of weights whose value in that forward changed. An update smaller than half a bf16 unit in
the last place of a weight rounds back to the weight's old value: at lr 6e-5, most of SmolLM2's
weights (norms ~1, ulp 2^-7; linear weights ~0.05, ulp ~2^-12) need several steps before their
bf16 copy moves at all.

    python benchmarks/bf16_update.py --teacher RUN --out benchmarks/results/bf16_update.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.settings import sampling_settings, teacher_args
from rayppo.actors.teacher import TeacherEngine
from rayppo.config.load import load_config
from rayppo.data.prompts import PromptBatch
from rayppo.learner import ppo
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.sequences import policy_forward_at
from rayppo.tasks import arithmetic

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parent / "examples" / "distill_arithmetic.yaml"
WAYS = ("fp32", "bf16 weights, fp32 masters", "fp32 weights, bf16 autocast")


def scored_batch(teacher: str, topk: int, prompts: int, seed: int) -> tuple[RolloutTensors, float]:
    """The student's samples of ``prompts`` arithmetic problems (the recipe's 8 each), scored with
    the teacher's top ``topk``; and the sampling temperature."""
    cfg = load_config(RECIPE, [f"distill.teacher={teacher}", "distill.mode=loss", f"distill.topk={topk}",
                               "model.dtype=float32"])
    path = str(resolve_model_path(cfg.model.policy))
    tokenizer = load_tokenizer(path)
    texts = [tokenizer.apply_chat_template(arithmetic.row(*problem)[0], add_generation_prompt=True, tokenize=False)
             for problem in arithmetic.problems("train", prompts, seed)]
    batch = PromptBatch(texts, [tokenizer(t)["input_ids"] for t in texts]).groups_of(cfg.rollout.samples_per_prompt)
    rollout = GeneratorEngine(path, sampling_settings(cfg), backend="hf").generate(batch, seed=seed)
    rollout = rollout.scored([0.0] * len(rollout), teacher=TeacherEngine(**teacher_args(cfg, 0.0)).teacher_logprobs(rollout))
    return RolloutTensors.of(rollout, tokenizer.pad_token_id), cfg.rollout.temperature


def mean_kl(model: torch.nn.Module, rows: RolloutTensors, temperature: float, autocast: bool) -> torch.Tensor:
    """The batch's token-mean top-k reverse KL under ``model`` (with its graph)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = policy_forward_at(model, rows.batch, rows.teacher_top_ids, temperature)
    assert out.at_ids is not None and rows.teacher_top_logprobs is not None  # the teacher sent its top k
    mask = rows.batch.mask
    return (ppo.topk_reverse_kl(out.at_ids.float(), rows.teacher_top_logprobs) * mask).sum() / mask.sum()


def steps(way: str, rows: RolloutTensors, temperature: float, lr: float, count: int) -> list[dict[str, float]]:
    """``count`` AdamW steps held ``way``; after each, the KL and the share of changed weights."""
    path = str(resolve_model_path("smollm2-135m-instruct"))
    model = load_causal_lm(path, "bfloat16" if way.startswith("bf16") else "float32")
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    optimiser = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    autocast = way.endswith("autocast")
    with torch.no_grad():
        points = [{"step": 0, "kl": mean_kl(model, rows, temperature, autocast).item(), "changed": 0.0}]
    for step in range(1, count + 1):
        model.zero_grad(set_to_none=True)
        mean_kl(model, rows, temperature, autocast).backward()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimiser.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)  # to the module's dtype: bf16 rounds, fp32 copies
            changed = sum(int((p != s).sum()) for p, s in zip(model.parameters(), start))
            total = sum(p.numel() for p in model.parameters())
            points.append({"step": step, "kl": mean_kl(model, rows, temperature, autocast).item(),
                           "changed": changed / total})
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", required=True, help="the GRPO recipe's run (its policy/ is the teacher)")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="problems in the batch (8 samples each)")
    parser.add_argument("--lr", type=float, default=6e-5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, temperature = scored_batch(args.teacher, args.topk, args.prompts, args.seed)
    result: dict[str, Any] = {"command": "python benchmarks/bf16_update.py --teacher RUN", "lr": args.lr,
                              "topk": args.topk, "responses": len(rows), "tokens": int(rows.batch.mask.sum()),
                              "ways": {}}
    for way in WAYS:
        result["ways"][way] = steps(way, rows, temperature, args.lr, args.steps)
        print(way, " ".join(f"step {p['step']}: KL {p['kl']:.3f} changed {p['changed']:.1%}"
                            for p in result["ways"][way]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
