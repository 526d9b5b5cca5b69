"""What a bf16 export gives when transformers reloads it: its LM head in bf16, the learner's in fp32.

rayppo's learner, reference and generators compute the LM head in fp32 whatever the model's dtype
(``models/vocab_head.py``, ``models/head_precision.py``, vLLM's ``head_dtype``), but a bf16 export
(``policy/`` after a ``model.dtype=bfloat16`` run) says ``"dtype": "bfloat16"`` in its config, and
``AutoModelForCausalLM.from_pretrained`` computes every layer, the head included, in bf16. This
measures the difference on SmolLM2-135M-Instruct (the converted folder loaded in bf16, which is
what a bf16 export of it is): the arithmetic task's held-out prompts, greedy responses of the fp32
head, then per response token |log p_bf16-head - log p_fp32-head| (mean, p99, max), its k3 mean,
and how often the greedy token differs.

    python benchmarks/export_head.py --prompts 64 --new-tokens 32 --out benchmarks/results/export_head.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rayppo.data.prompts import load_prompt_set
from rayppo.models.head_precision import set_head_fp32
from rayppo.models.loading import load_tokenizer, resolve_model_path


def response_logprobs(model, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p of each response token, argmax token)`` [B, T] under teacher forcing."""
    with torch.no_grad():
        logits = model(ids).logits[:, prompt_len - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1), logits.argmax(-1)


def measure(prompts: int, new_tokens: int) -> dict:
    folder = resolve_model_path("smollm2-135m-instruct")
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    rows = load_prompt_set("arithmetic", "prompt", tokenizer, 256, split="test")
    gaps, k3s, flips, start = [], [], [], time.perf_counter()
    for ids in rows.ids[:prompts]:
        prompt = torch.tensor([ids])
        set_head_fp32(model, True)  # the learner's head: the responses it would sample greedily
        with torch.no_grad():
            full = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        fp32, fp32_argmax = response_logprobs(model, full, len(ids))
        set_head_fp32(model, False)  # as transformers reloads the export
        bf16, bf16_argmax = response_logprobs(model, full, len(ids))
        d = (bf16 - fp32).double().flatten()
        gaps.append(d.abs())
        k3s.append(torch.expm1(d) - d)
        flips.append((fp32_argmax != bf16_argmax).double().flatten())
    gap, k3, flip = torch.cat(gaps), torch.cat(k3s), torch.cat(flips)
    return {"model": "SmolLM2-135M-Instruct, bf16 decoder", "prompts": prompts, "tokens": int(gap.numel()),
            "mean": float(gap.mean()), "p99": float(gap.quantile(0.99)), "max": float(gap.max()),
            "k3_mean": float(k3.mean()), "greedy_token_differs": float(flip.mean()),
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.prompts, args.new_tokens)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
