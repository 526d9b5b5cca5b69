"""What per-row seeds cost vLLM on CPU: the generation throughput of one call without request seeds
(chunked prefill on: rayppo's sampling before rows had seeds of their own) and with a seed per
request (chunked prefill off, as rayppo runs it now), side by side in one process, on the embedded
model or any model folder.

    python benchmarks/sampling_seeds.py --rows 64 --tokens 48 --repeats 5

Prints and writes ``OUT/sampling_seeds.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _engine(model: str, per_row_seeds: bool):
    from vllm import LLM

    from rayppo.models.shape import max_positions

    context = min(max_positions(model) or 2048, 2048)
    extra = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, context)} if per_row_seeds else {}
    return LLM(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=context, enforce_eager=True,
               generation_config="vllm", **extra)


def _throughput(model: str, per_row_seeds: bool, rows: int, tokens: int, repeats: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rayppo.actors.hf_backend import sample_seeds

    llm = _engine(model, per_row_seeds)
    prompts = [TokensPrompt(prompt_token_ids=[1, 5 + i % 7, 9, 11 + i % 5]) for i in range(rows)]
    seconds = []
    for call in range(repeats + 1):  # the first call warms up
        seeds = sample_seeds(call, range(rows)) if per_row_seeds else [None] * rows
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=s, logprobs=0,
                                 flat_logprobs=True, detokenize=False) for s in seeds]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if call:
            seconds.append(time.perf_counter() - start)
    del llm
    gc.collect()
    median = statistics.median(seconds)
    return {"seconds_median": round(median, 4), "tokens_per_s": round(rows * tokens / median, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="runs/sampling_seeds")
    args = parser.parse_args()
    from rayppo.models.loading import resolve_model_path

    model = str(resolve_model_path(args.model))
    result = {"rows": args.rows, "tokens": args.tokens, "repeats": args.repeats,
              "one_seed_per_call": _throughput(model, False, args.rows, args.tokens, args.repeats),
              "seed_per_row": _throughput(model, True, args.rows, args.tokens, args.repeats)}
    result["ratio"] = round(result["seed_per_row"]["tokens_per_s"] / result["one_seed_per_call"]["tokens_per_s"], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_seeds.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
