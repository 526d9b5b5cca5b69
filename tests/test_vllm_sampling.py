"""What a vLLM generator samples: EOS handling and each row's own noise (a real CPU engine)."""

from __future__ import annotations

import gc

import pytest

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.actors.settings import generator_seed
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.models.sequences import pack
from rayppo.trainers.iteration import group_shares

pytestmark = pytest.mark.slow

PROMPTS = ["say 7 :", "write 3 :", "give 1 :", "repeat 5 :"] * 8


def _engine(embedded_dir, seed: int, **sampling) -> GeneratorEngine:
    settings = SamplingSettings(**({"max_new_tokens": 12} | sampling))
    return GeneratorEngine(str(embedded_dir), settings, backend="vllm",
                           actor=GeneratorActor(seed=seed, vllm=VLLMSettings(kv_cache_gib=1)))


def _batch(tokenizer, texts=PROMPTS) -> PromptBatch:
    return PromptBatch(list(texts), [tokenizer(t)["input_ids"] for t in texts])


@pytest.fixture(scope="module")
def vllm_env():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    monkeypatch.undo()


def test_emitted_eos_is_in_the_response_and_mask_and_a_cut_is_length(vllm_env, embedded_dir, tokenizer):
    engine = _engine(embedded_dir, seed=0, max_new_tokens=6)
    rollout = engine.generate(_batch(tokenizer), seed=0)
    eos = tokenizer.eos_token_id
    mask = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id).mask
    assert set(rollout.finish_reason) == {"stop", "length"}  # 3..8 digits then EOS: some reach the cap of 6
    for i, (ids, reason) in enumerate(zip(rollout.response_ids, rollout.finish_reason)):
        assert int(mask[i].sum()) == len(ids) == len(rollout.logprobs[i])  # the EOS token is in the mask
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == 6 and eos not in ids

    # Near-greedy sampling makes a response reproducible across length limits: an EOS that is
    # exactly the last allowed token is still a stop; one token less is a cut.
    engine.sampling = SamplingSettings(max_new_tokens=12, temperature=1e-3)
    greedy = engine.generate(_batch(tokenizer, ["say 7 :"]), seed=0)
    ids = greedy.response_ids[0]
    assert greedy.finish_reason == ["stop"] and ids[-1] == eos
    engine.sampling = SamplingSettings(max_new_tokens=len(ids), temperature=1e-3)
    exact = engine.generate(_batch(tokenizer, ["say 7 :"]), seed=0)
    assert exact.response_ids == [ids] and exact.finish_reason == ["stop"]
    engine.sampling = SamplingSettings(max_new_tokens=len(ids) - 1, temperature=1e-3)
    cut = engine.generate(_batch(tokenizer, ["say 7 :"]), seed=0)
    assert cut.response_ids == [ids[:-1]] and cut.finish_reason == ["length"]


def test_a_rollout_is_the_same_whichever_generators_draw_its_rows(vllm_env, embedded_dir, tokenizer):
    """Each row's noise is its own seed's (``sample_seeds``: call seed, group, place in the group):
    one engine drawing the whole batch and another engine (another engine seed, as generator 1
    has) drawing it in two shares, in reverse order, sample the same tokens. A call seed that
    differs draws other samples; the same one again, the same."""
    batch = _batch(tokenizer, PROMPTS[:8])

    def sample(generator_id: int, shares: int, seed: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        engine = _engine(embedded_dir, seed=generator_seed(0, generator_id))
        try:
            parts = [engine.generate(share, seed=seed) for share in reversed(group_shares(batch, shares, 4))]
        finally:
            del engine
            gc.collect()
        rollout = Rollout.concat(parts[::-1])
        return rollout.response_ids, rollout.logprobs

    whole, logprobs = sample(0, 1)
    split, split_logprobs = sample(1, 2)
    assert split == whole  # exactly: same seeds, same tokens
    # The two calls batch different rows together; vLLM's CPU kernels give a row the same fp32
    # logits whatever else is in the batch up to the order of a reduction (a few ulp of log-probs
    # of magnitude < 10: 4 * 2**-23 * 10 = 5e-6).
    gap = max(abs(a - b) for x, y in zip(logprobs, split_logprobs) for a, b in zip(x, y))
    print(f"log-prob gap between splits: {gap:.2e}")
    assert gap <= 5e-6, gap
    assert len({tuple(r) for r in whole}) > len(whole) // 2  # the rows of a group draw their own noise
    other, _ = sample(0, 1, seed=1)
    assert sum(a != b for a, b in zip(whole, other)) > len(whole) // 2


def test_a_groups_samples_share_the_prompt_in_the_prefix_cache_and_each_draws_its_own_noise(
        vllm_env, embedded_dir, tokenizer):
    """rollout.samples_per_prompt = 8: the prompt's 8 requests are one group (its id on every row),
    the engine's prefix cache is on (they share the prompt's KV blocks), and the 8 responses are not
    copies of one draw."""
    engine = _engine(embedded_dir, seed=generator_seed(0, 0))
    try:
        assert engine.backend.prefix_caching and "no prefix cache" not in engine.describe()
        rollout = engine.generate(_batch(tokenizer, ["say 7 :", "write 3 :"]).groups_of(8, first_group=5), seed=0)
    finally:
        del engine
        gc.collect()
    assert rollout.group_id == [5] * 8 + [6] * 8
    for g in range(2):
        responses = {tuple(r) for r in rollout.response_ids[8 * g: 8 * g + 8]}
        assert len(responses) >= 4, responses  # at temperature 1 over ~12 tokens, repeats are rare


def test_vllm_stops_on_the_generation_configs_eos_ids_like_the_hf_backend(vllm_env, tokenizer, copy_model):
    seven = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    folder = copy_model("two_eos", eos_token_id=[tokenizer.eos_token_id, seven])
    engine = GeneratorEngine(str(folder), SamplingSettings(max_new_tokens=8), backend="vllm",
                             actor=GeneratorActor(seed=0, vllm=VLLMSettings(kv_cache_gib=1)))
    rollout = engine.generate(_batch(tokenizer, ["say 7 :"] * 16), seed=0)
    for ids, reason in zip(rollout.response_ids, rollout.finish_reason):
        assert seven not in ids[:-1] and tokenizer.eos_token_id not in ids[:-1]
        assert (reason == "stop") == (ids[-1] in (seven, tokenizer.eos_token_id))
    assert any(ids[-1] == seven for ids in rollout.response_ids)  # the stop token is kept in the response


def test_the_gpu_runner_samples_each_request_with_its_own_seed():
    """vLLM 0.32's V2 model runner (the GPU default) keeps a seeded request's seed
    (``SamplingStates.add_request``, vllm/v1/worker/gpu/sample/states.py) and draws its noise from
    it; it would draw a seed from numpy's global generator only for a request without one. The
    upstream method runs here on stand-in buffers (its own are pinned memory, CUDA only)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    from rayppo.actors.hf_backend import sample_seeds

    seeds = sample_seeds(0, [0, 0, 1, 1])

    def buffer(dtype):
        return SimpleNamespace(np=np.zeros(len(seeds), dtype=dtype))

    states = SimpleNamespace(temperature=buffer(np.float32), top_k=buffer(np.int32), top_p=buffer(np.float32),
                             min_p=buffer(np.float32), seeds=buffer(np.int64), vocab_size=100,
                             seeds_set=np.zeros(len(seeds), dtype=bool), num_logprobs=np.empty(len(seeds), dtype=np.int32))
    for i, seed in enumerate(seeds):
        SamplingStates.add_request(states, i, SamplingParams(temperature=1.0, seed=seed))
    assert states.seeds.np.tolist() == seeds and states.seeds_set.all()
