"""Generation throughput of multi-turn episodes against single-turn responses on the same model,
and of the two ways to schedule episodes on vLLM.

    python benchmarks/multi_turn_generation.py [--backend vllm|hf] [--episodes 128] [--repeats 3]

The embedded multi-turn model (``embedded-guess``) plays the guessing game through one generator
engine (a turn per batched call, the environment in its child processes); then the same engine
kind samples single-turn responses from the same prompts at a fixed length (``ignore_eos``) equal
to the episodes' mean length, the same tokens after the prompt. Reports tokens per second of both
(every token after the prompt; for episodes also the sampled ones), one JSON line; the episodes'
seconds include their environment steps.

With vLLM it also plays the same episodes *continuously* (``continuous_*``): every episode's next
turn is submitted to vLLM's engine (``LLMEngine.add_request`` / ``step``, continuous batching) as
soon as its environment answered, instead of a turn-by-turn barrier where the batch waits for the
turn's longest answer. The environment, the pool of its processes and the token rules are the
generator's own (``rayppo.episodes.turn_loop``); only the schedule differs. rayppo's generator uses
the turn-by-turn schedule: this measures what the other would give.
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

    from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
    from rayppo.data.prompts import load_prompt_set
    from rayppo.episodes.turn_loop import EpisodeSettings
    from rayppo.models.loading import resolve_model_path

    path = str(resolve_model_path("embedded-guess"))
    sampling = SamplingSettings(40, 1.0)
    episodes = EpisodeSettings(GUESS, max_turns=6, max_tokens=40, workers=4)
    player = GeneratorEngine(path, sampling, backend=args.backend, episodes=episodes,
                             actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    prompts = load_prompt_set("embedded-guess", "prompt", player.tokenizer, 24).select(range(args.episodes))
    player.warmup()
    player.generate(prompts, seed=0)  # the environment processes start here, outside the timings
    multi = {"seconds": 0.0, "tokens": 0, "actions": 0, "turns": 0}
    continuous = {"seconds": 0.0, "tokens": 0}
    for r in range(args.repeats):  # the two schedules one after the other in each repeat: side by side
        start = time.perf_counter()
        rollout = player.generate(prompts, seed=r + 1)
        multi["seconds"] += time.perf_counter() - start
        multi["tokens"] += sum(len(ids) for ids in rollout.response_ids)
        multi["actions"] += sum(sum(mask) for mask in rollout.action_mask)
        multi["turns"] += sum(len(ends) for ends in rollout.turn_ends)
        if args.backend == "vllm":
            start = time.perf_counter()
            states = play_continuously(player, prompts, episodes)
            continuous["seconds"] += time.perf_counter() - start
            continuous["tokens"] += sum(len(s.response_ids) for s in states)
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
    if args.backend == "vllm":
        out["continuous_tokens_per_s"] = continuous["tokens"] / continuous["seconds"]
        out["continuous_over_turns"] = out["continuous_tokens_per_s"] / out["multi_turn_tokens_per_s"]
    print(json.dumps(out))
    return 0


def play_continuously(player, prompts, settings) -> list:
    """The episodes of ``prompts`` on ``player``'s vLLM engine with continuous batching: a turn is
    submitted the moment its episode's previous observation is known. Returns the episode states."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rayppo.actors.vllm_backend import sampled_logprobs
    from rayppo.episodes.environment import Episode
    from rayppo.episodes.turn_loop import EpisodeState, SampledTurn, answer_turn, take_turn, turn_limit

    engine, tok, pool = player.backend.llm.llm_engine, player.tokenizer, player._pool
    states = [EpisodeState(Episode(i, text, prompts.fields[i], prompts.messages[i]), list(ids), list(prompts.messages[i]))
              for i, (text, ids) in enumerate(zip(prompts.texts, prompts.ids))]
    pool.start([s.episode for s in states])

    def submit(i: int) -> None:
        state = states[i]
        params = SamplingParams(temperature=player.sampling.temperature, max_tokens=turn_limit(state, settings),
                                stop_token_ids=player.backend.eos_ids, logprobs=0, flat_logprobs=True,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"{i}.{len(state.turn_ends)}", TokensPrompt(prompt_token_ids=state.context), params)

    for i in range(len(states)):
        submit(i)
    while engine.has_unfinished_requests():
        stepping = []
        for out in engine.step():
            if not out.finished:
                continue
            i, sample = int(out.request_id.split(".")[0]), out.outputs[0]
            ids = list(sample.token_ids)
            reason = "length" if sample.finish_reason == "length" else "stop"
            turn = SampledTurn(ids, sampled_logprobs(sample.logprobs, ids), reason)
            text = take_turn(states[i], turn, player.turn_end_ids, tok, len(states[i].turn_ends) + 1)
            if text is not None:
                stepping.append((i, text))
        if not stepping:
            continue
        answers = pool.step([states[i].episode for i, _ in stepping], [t for _, t in stepping], 0)
        for (i, text), answer in zip(stepping, answers):
            answer_turn(states[i], text, answer, tok, settings, len(states[i].turn_ends) == settings.max_turns)
            if not states[i].finish_reason:
                submit(i)
    pool.end([s.episode for s in states])
    return states


if __name__ == "__main__":
    sys.exit(main())
