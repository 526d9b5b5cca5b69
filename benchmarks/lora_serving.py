"""What serving a LoRA adapter costs vLLM's CPU generation, one engine, modes interleaved.

One in-process vLLM engine on SmolLM2-135M-Instruct with LoRA enabled (r = 16 on every linear
layer, B drawn so that the adapter changes the samples) generates the bench workload's batch (16
prompts x 4 samples x 32 tokens) in three modes, round after round so that the machine's drift
falls on all three alike:

- ``one-slot``: rayppo's product for a packed layer whose tokens all use one adapter
  (``actors/cpu_lora.py``, ``one_slot_lora_linear``: what every synchronous rayppo batch is);
- ``per-slice``: vLLM 0.32's ``PunicaWrapperCPU.add_lora_linear`` order, two ops per slice, with
  rayppo's grouped products (``grouped_products``) inside;
- ``no adapter``: the same engine, requests naming no adapter (the base model).

    python benchmarks/lora_serving.py --dtype bfloat16 --rounds 5 --out benchmarks/results/lora_serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("one-slot", "per-slice", "no adapter")


def engine_with_adapter(dtype: str):
    """A vLLM generator on SmolLM2 serving a random r = 16 adapter as policy version 1."""
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
    from rayppo.learner.adapter_weights import adapter_config, adapter_tensors, policy_lora, wrap_lora
    from rayppo.models.loading import load_causal_lm, resolve_model_path
    from rayppo.models.weights import pack_weights

    path = str(resolve_model_path("smollm2-135m-instruct"))
    sampling = SamplingSettings(max_new_tokens=32, temperature=1.0, ignore_eos=True)
    engine = GeneratorEngine(path, sampling, backend="vllm", dtype=dtype,
                             actor=GeneratorActor(vllm=VLLMSettings(lora_rank=16)))
    model = wrap_lora(load_causal_lm(path, dtype), policy_lora(16, 32.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(len(name)))
    named = {name: t.clone() for name, t in adapter_tensors(model)}
    engine.load_weights(pack_weights(named, 1, adapter=adapter_config(model)))
    return engine


def batch(tokenizer):
    from rayppo.data.prompts import load_prompt_set

    prompts = load_prompt_set("arithmetic", "prompt", tokenizer, max_tokens=256)
    return prompts.select([i for i in range(16) for _ in range(4)])  # 16 prompts x 4 samples


def measure(dtype: str, rounds: int) -> dict:
    from rayppo.actors import cpu_lora as patched

    cpu_lora: Any = patched  # its single_slot is swapped per mode below
    engine = engine_with_adapter(dtype)
    prompts = batch(engine.tokenizer)
    engine.generate(prompts, 0)  # warm-up
    one_slot = cpu_lora.single_slot
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES:
            cpu_lora.single_slot = one_slot if mode == "one-slot" else (lambda indices: None)
            engine.backend.adapter = None if mode == "no adapter" else 1
            start = time.perf_counter()
            engine.generate(prompts, r + 1)
            seconds[mode].append(time.perf_counter() - start)
    cpu_lora.single_slot = one_slot
    medians = {mode: statistics.median(s) for mode, s in seconds.items()}
    return {"model": "smollm2-135m-instruct", "dtype": dtype, "lora_rank": 16, "rows": len(prompts),
            "new_tokens": 32, "cores": os.cpu_count(), "rounds": rounds, "seconds": seconds,
            "median_s": medians, "adapter_cost_s": {mode: medians[mode] - medians["no adapter"] for mode in MODES[:2]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = measure(args.dtype, args.rounds)
    for mode in MODES:
        print(f"{args.dtype} {mode:10s} median {result['median_s'][mode]:.2f} s per batch  "
              f"{[round(s, 2) for s in result['seconds'][mode]]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
