"""Generation throughput of multi-turn episodes against single-turn responses on the same model.

    python benchmarks/multi_turn_generation.py [--backend vllm|hf] [--episodes 128] [--repeats 3]

The embedded multi-turn model (``embedded-guess``) plays the guessing game through one generator
engine (a turn per batched call, the environment in its child processes); then the same engine
kind samples single-turn responses from the same prompts at a fixed length (``ignore_eos``) equal
to the episodes' mean length, the same tokens after the prompt. Reports tokens per second of both
(every token after the prompt; for episodes also the sampled ones), one JSON line; the episodes'
seconds include their environment steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

GUESS = "rayppo.tasks.guess:HigherLower"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rayppo.actors.generator import GeneratorEngine, SamplingSettings, VLLMSettings
    from rayppo.data.prompts import load_prompt_set
    from rayppo.episodes.loop import EpisodeSettings
    from rayppo.models.loading import resolve_model_path

    path = str(resolve_model_path("embedded-guess"))
    sampling = SamplingSettings(40, 1.0)
    episodes = EpisodeSettings(GUESS, max_turns=6, max_tokens=40, workers=4)
    player = GeneratorEngine(path, sampling, backend=args.backend, episodes=episodes, vllm=VLLMSettings(kv_cache_gib=1))
    prompts = load_prompt_set("embedded-guess", "prompt", player.tokenizer, 24).select(range(args.episodes))
    player.warmup()
    player.generate(prompts, seed=0)  # the environment processes start here, outside the timings
    multi = {"seconds": 0.0, "tokens": 0, "actions": 0, "turns": 0}
    for r in range(args.repeats):
        start = time.perf_counter()
        rollout = player.generate(prompts, seed=r + 1)
        multi["seconds"] += time.perf_counter() - start
        multi["tokens"] += sum(len(ids) for ids in rollout.response_ids)
        multi["actions"] += sum(sum(mask) for mask in rollout.action_mask)
        multi["turns"] += sum(len(ends) for ends in rollout.turn_ends)
    length = round(multi["tokens"] / (args.repeats * args.episodes))
    single_engine = player  # the same engine, its episodes off: single-turn responses of the same length
    single_engine.episodes = None
    single_engine.sampling = replace(sampling, max_new_tokens=length, ignore_eos=True)
    single = {"seconds": 0.0, "tokens": 0}
    for r in range(args.repeats):
        start = time.perf_counter()
        rollout = single_engine.generate(prompts, seed=r + 1)
        single["seconds"] += time.perf_counter() - start
        single["tokens"] += sum(len(ids) for ids in rollout.response_ids)
    out = {"backend": args.backend, "episodes": args.episodes, "repeats": args.repeats,
           "episode_length_mean": multi["tokens"] / (args.repeats * args.episodes),
           "turns_mean": multi["turns"] / (args.repeats * args.episodes),
           "multi_turn_tokens_per_s": multi["tokens"] / multi["seconds"],
           "multi_turn_sampled_tokens_per_s": multi["actions"] / multi["seconds"],
           "single_turn_tokens_per_s": single["tokens"] / single["seconds"],
           "multi_over_single": (multi["tokens"] / multi["seconds"]) / (single["tokens"] / single["seconds"])}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
