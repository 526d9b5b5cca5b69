"""The sampler-vs-learner log-prob gap in bf16, with and without the fp32 LM head.

One random-init Llama of a real shape (SmolLM2-135M's by default: 30 layers x 576, 9 heads, 3 KV
heads, a 49,152-token tied vocabulary) samples responses the way an inference engine does:
transformers' KV-cache decoding, one token per step, each token drawn from
``softmax(logits / T)`` of that step's logits, its log-prob recorded (μ). The learner then
recomputes the same tokens in one forward over prompt + response (π), as rayppo's learner does
(``models/sequences.policy_forward``, the chunked head of ``models/vocab_head.py``). The gap
|log μ − log π| per token (mean, p99, max) is reported for each precision of the head on the two
sides:

- ``bf16_head``: both heads in the model's dtype (what transformers and vLLM do by default, and
  what rayppo's learner did before its fp32 head);
- ``fp32_head``: both heads in fp32 (``models/head_precision.py`` on the decoding side, rayppo's
  learner as it is);
- ``fp32`` model: the whole model in fp32, for scale.

A random-init model's logits are nearly flat (std ~0.5 at the usual init), which hides most of the
head's rounding; ``--head-std`` scales the tied embedding so that the logits spread like a trained
model's (std ~5 at 0.2). ``benchmarks/gpu_smoke.py --mismatch`` runs this on CUDA; on a CPU:

    python benchmarks/head_mismatch.py --device cpu --layers 2 --batch 4 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayppo.models.head_precision import set_head_fp32
from rayppo.models.sequences import PackedBatch, pack, policy_forward

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5)


def build(layers: int, head_std: float, seed: int) -> LlamaForCausalLM:
    """The random-init model in fp32 (cast per measurement), its tied embedding at ``head_std``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(SMOLLM2_135M | {"num_hidden_layers": layers})))
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, head_std)
    return model.eval()


@torch.no_grad()
def decode(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, temperature: float,
           seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(responses [B, N], logprobs [B, N])`` sampled one step at a time through the KV cache."""
    generator = torch.Generator(device=prompts.device).manual_seed(seed)
    out = model(input_ids=prompts, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
        tokens.append(token)
        logprobs.append(logp.gather(1, token))
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


@torch.no_grad()
def learner_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float, head_fp32: bool) -> torch.Tensor:
    """``[B, T]``: rayppo's learner forward (fp32 head) or the same hidden states through the head
    in the model's dtype (the learner before its fp32 head); 0 on padding."""
    if head_fp32:
        return policy_forward(model, batch, temperature)[0]
    lm: Any = model  # a transformers causal LM: its decoder and head are untyped here
    hidden = lm.model(**batch.model_inputs(), use_cache=False).last_hidden_state
    columns = slice(batch.prompt_width - 1, batch.prompt_width - 1 + batch.response_ids.shape[1])
    logits = (hidden[:, columns] @ lm.lm_head.weight.t()).float() / temperature  # rounded to bf16, then fp32
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, batch.response_ids.unsqueeze(2)).squeeze(2)
    return logprobs * batch.mask


def gap_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    gap = (a.double() - b.double()).abs().flatten()
    return {"mean": float(gap.mean()), "p99": float(gap.quantile(0.99)), "max": float(gap.max())}


def measure(layers: int = 30, batch: int = 32, prompt_tokens: int = 32, new_tokens: int = 128,
            temperature: float = 1.0, head_std: float = 0.2, device: str = "cuda", seed: int = 0) -> dict[str, Any]:
    """The gap table: one row per (model dtype, head precision)."""
    base = build(layers, head_std, seed)
    prompts = torch.randint(3, base.config.vocab_size, (batch, prompt_tokens),
                            generator=torch.Generator().manual_seed(seed)).to(device)
    rows = {}
    for name, dtype, fp32 in (("bf16_head", torch.bfloat16, False), ("fp32_head", torch.bfloat16, True),
                              ("fp32", torch.float32, True)):
        model = build(layers, head_std, seed).to(device=device, dtype=dtype)
        set_head_fp32(model, fp32)
        start = time.perf_counter()
        responses, behaviour = decode(model, prompts, new_tokens, temperature, seed + 1)
        packed = pack(prompts.tolist(), responses.tolist(), pad_id=0).to(device)  # not ``batch``: the row count
        learner = learner_logprobs(model, packed, temperature, fp32)
        rows[name] = gap_stats(behaviour, learner) | {"seconds": time.perf_counter() - start}
        del model
    return {"layers": layers, "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "temperature": temperature, "head_std": head_std, "device": device,
            "logit_std": float(_logit_std(base, prompts.cpu())), "gap": rows}


@torch.no_grad()
def _logit_std(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    return model(input_ids=prompts[:2]).logits.float().std()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--head-std", type=float, nargs="+", default=[0.02, 0.2],
                        help="std of the tied embedding (0.02: the usual init, flat logits; 0.2: logits spread "
                             "like a trained model's)")
    args = parser.parse_args(argv)
    for std in args.head_std:
        print(json.dumps(measure(args.layers, args.batch, 32, args.new_tokens, 1.0, std, args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
