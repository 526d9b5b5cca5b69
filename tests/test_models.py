"""Model plumbing: log-probs, values, generation and reward scoring on the embedded model."""

import os

import pytest
import torch

from rayppo.actors.generator import GeneratorEngine, SamplingSettings, split_response
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import ModelScorer, RewardEngine, RewardError, Verifier
from rayppo.config.schema import ConfigError
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.learner.rollout_tensors import padded
from rayppo.models.loading import Critic, load_causal_lm, load_reward_model, load_tokenizer
from rayppo.models.sequences import critic_forward, pack, policy_forward

PROMPTS = ["say 7 :", "write 1 :", "give 3 :"]


@pytest.fixture(scope="module")
def policy(embedded_dir):
    return load_causal_lm(embedded_dir).eval()


@pytest.fixture(scope="module")
def critic(embedded_dir):
    torch.manual_seed(0)
    return Critic.from_pretrained(embedded_dir).eval()


def pairs(tokenizer):
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompt_ids[1] = prompt_ids[1][1:]  # a shorter prompt (no BOS) to force left padding
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in ("7 7 7", "1", "3 2 3 3 3")]
    response_ids[0].append(tokenizer.eos_token_id)
    return prompt_ids, response_ids


def test_embedded_model_shape_and_tokenizer(embedded_dir, tokenizer, policy):
    cfg = policy.config
    assert cfg.model_type == "llama" and cfg.hidden_size // cfg.num_attention_heads == 64
    ids = tokenizer("say 7 :")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 4
    assert tokenizer.decode(tokenizer("7 3 7", add_special_tokens=False)["input_ids"]) == "7 3 7"


@torch.no_grad()
def test_logprobs_match_a_plain_forward_and_ignore_padding(tokenizer, policy):
    prompt_ids, response_ids = pairs(tokenizer)
    batch = pack(prompt_ids, response_ids, tokenizer.pad_token_id)
    temperature = 0.7
    logprobs, entropy = policy_forward(policy, batch, temperature, with_entropy=True)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        logits = policy(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1] / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[i, : len(r)], expected, atol=1e-5, rtol=1e-5)
        assert (logprobs[i, len(r):] == 0).all() and (entropy[i, len(r):] == 0).all()


@torch.no_grad()
def test_values_and_last_value_come_from_the_right_positions(tokenizer, critic):
    prompt_ids, response_ids = pairs(tokenizer)
    batch = pack(prompt_ids, response_ids, tokenizer.pad_token_id)
    values, last_values = critic_forward(critic, batch)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids = torch.tensor([p + r])
        alone = critic(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0]
        # values[t] = V(S_{t-1}): the position before response token t; last = V(S_T)
        torch.testing.assert_close(values[i, : len(r)], alone[len(p) - 1 : len(p) + len(r) - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last_values[i], alone[-1], atol=1e-5, rtol=1e-5)


def test_critic_save_and_load_roundtrip(tmp_path, critic):
    critic.save_pretrained(tmp_path / "critic")
    again = Critic.from_pretrained(tmp_path / "critic")
    torch.testing.assert_close(again.value_head.weight, critic.value_head.weight)


def test_split_response():
    assert split_response([5, 6, 3, 0, 0], eos_ids=[3]) == ([5, 6, 3], "stop")
    assert split_response([5, 6, 7], eos_ids=[3]) == ([5, 6, 7], "length")
    assert split_response([5, 9, 6, 3], eos_ids=[3, 9]) == ([5, 9], "stop")  # any EOS id ends it
    # No padding follows a row without EOS: a pad id there was sampled, and stays.
    assert split_response([5, 6, 0, 0], eos_ids=[3]) == ([5, 6, 0, 0], "length")


def test_generator_reports_sampling_logprobs_and_finish_reasons(embedded_dir, tokenizer, policy):
    engine = GeneratorEngine(str(embedded_dir), SamplingSettings(max_new_tokens=5, temperature=0.8), backend="hf")
    prompts = PromptBatch(PROMPTS * 6, [tokenizer(p)["input_ids"] for p in PROMPTS * 6])
    rollout = engine.generate(prompts, seed=1)
    assert set(rollout.finish_reason) == {"stop", "length"}  # 3..8 digit answers vs a 5-token cap
    for ids, reason in zip(rollout.response_ids, rollout.finish_reason):
        assert (ids[-1] == tokenizer.eos_token_id) == (reason == "stop")
        assert len(ids) == 5 or reason == "stop"
    batch = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = policy_forward(policy, batch, temperature=0.8)
    torch.testing.assert_close(padded(rollout.logprobs), recomputed, atol=1e-5, rtol=1e-5)
    assert rollout.policy_version == [0] * len(rollout)
    same = engine.generate(prompts, seed=1)
    assert same.response_ids == rollout.response_ids  # seeded


def test_reference_engine_equals_policy_forward(embedded_dir, tokenizer, policy):
    prompt_ids, response_ids = pairs(tokenizer)
    rollout = Rollout(prompt_ids, response_ids, [[0.0] * len(r) for r in response_ids], ["stop"] * 3,
                      PROMPTS, ["", "", ""])
    engine = ReferenceEngine(str(embedded_dir), temperature=1.0, batch_size=2)
    assert engine.layout == "varlen"  # a Llama on SDPA: one packed row, attention per sequence (the padded path below)
    ref = engine.ref_logprobs(rollout)
    with torch.no_grad():
        expected, _ = policy_forward(policy, pack(prompt_ids, response_ids, tokenizer.pad_token_id))
    for i, r in enumerate(response_ids):
        assert ref[i] == pytest.approx(expected[i, : len(r)].tolist(), abs=1e-5)


def _text_rollout(prompts, responses):
    n = len(prompts)
    return Rollout([[1]] * n, [[1]] * n, [[0.0]] * n, ["stop"] * n, prompts, responses)


def test_verifier_reward_and_its_errors():
    engine = RewardEngine(Verifier("rayppo.tasks.digits:reward"))
    assert engine.scores(_text_rollout(["say 7 :", "say 7 :"], ["7 7 1 7", "7"])) == [0.75, 0.25]
    with pytest.raises(RewardError, match=r"failed on prompt 'hello there'"):
        engine.scores(_text_rollout(["say 7 :", "hello there"], ["7", "7"]))
    with pytest.raises(ConfigError, match="^reward.function: module 'rayppo.tasks.digits' has no 'nope'$"):
        RewardEngine(Verifier("rayppo.tasks.digits:nope"))


def test_reward_model_rescores_text_with_its_own_tokenizer(reward_model_dir, tokenizer):
    rm_tokenizer = load_tokenizer(reward_model_dir)
    assert rm_tokenizer("7")["input_ids"] != tokenizer("7")["input_ids"]  # different vocabularies
    prompts, responses = ["say 7 :", "give 1 :", "write 2 :"], ["7 7", "1 2 3 4 5", "2"]
    scores = RewardEngine(ModelScorer(str(reward_model_dir), batch_size=2)).scores(_text_rollout(prompts, responses))
    model = load_reward_model(reward_model_dir).eval()
    with torch.no_grad():
        for p, r, s in zip(prompts, responses, scores):
            alone = model(**rm_tokenizer(f"{p} {r}", return_tensors="pt")).logits[0, 0].item()
            assert s == pytest.approx(alone, abs=1e-5)


def test_reward_model_reads_a_groups_shared_prompt_once_and_scores_as_each_text_alone(reward_model_dir):
    """GRPO's rows: 3 and 2 responses to two prompts, one alone, an empty response. The packed pass
    runs each group's common token prefix once and gives each text's score alone.

    fp64 on both sides: the packed and padded passes sum the same terms in another order (~1e-16);
    transformers' RMSNorm rounds to fp32 inside, where that noise can flip a rounding (one fp32 ulp,
    6e-8 relative, of a hidden state), which the 2 layers and the score head (weights ~0.1, 64 wide)
    carry to at most ~1e-6 of a score of magnitude ~1."""
    rm_tokenizer = load_tokenizer(reward_model_dir)
    prompts = ["say 7 :"] * 3 + ["give 1 :"] + ["write 2 :"] * 2
    responses = ["7 7", "1 2 3 4 5", "", "1", "2", "2 2 9"]
    engine = RewardEngine(ModelScorer(str(reward_model_dir), batch_size=8))
    assert engine.shared_prefix  # a Llama classifier on SDPA
    engine.model.double()
    seen: list[int] = []
    backbone = engine.model.model
    handle = backbone.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    scores = engine.scores(_text_rollout(prompts, responses))
    handle.remove()
    texts = [f"{p} {r}" for p, r in zip(prompts, responses)]
    ids = [rm_tokenizer(t)["input_ids"] for t in texts]
    shared = sum((len(rows) - 1) * len(os.path.commonprefix([ids[i] for i in rows])) for rows in ([0, 1, 2], [4, 5]))
    assert shared > 0 and seen == [sum(map(len, ids)) - shared]  # one pass, each group's prefix once
    model = load_reward_model(reward_model_dir).double().eval()
    with torch.no_grad():
        for t, s in zip(texts, scores):
            assert s == pytest.approx(model(**rm_tokenizer(t, return_tensors="pt")).logits[0, 0].item(), abs=1e-6)


def test_stop_words_give_the_benchmark_model_long_tailed_lengths(tmp_path):
    """``build_random_llama(eos_mean_length=...)``: responses sampled from the model (temperature 1,
    no top-k) are that long on average and about geometric, a tail reaching 3x the mean.

    Bound on the mean: a truncated geometric of mean 8 has a std of ~6.5, so the mean of 256 rows
    is within 4 x 6.5 / 16 = 1.6 of its expectation; the calibration's own 64 paths and its integer
    count of stop words (each moves the mean by ~mean^2 / vocab = 0.13) add at most 1 more.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayppo.models.embedded import build_random_llama
    from rayppo.tasks import digits

    mean, cap, rows = 8, 32, 256
    build_random_llama(tmp_path, 512, eos_mean_length=mean, eos_length_cap=cap, max_position_embeddings=64)
    model, tok = AutoModelForCausalLM.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    torch.manual_seed(3)  # other samples than the calibration's
    enc = tok(digits.prompts(rows, 5), return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cap,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    responses = out[:, enc["input_ids"].shape[1]:].tolist()
    lengths = sorted(r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else cap for r in responses)
    assert abs(sum(lengths) / rows - mean) < 1.6 + 1.0, lengths
    p50, p90 = lengths[rows // 2], lengths[int(0.9 * rows)]
    assert p90 >= 2 * p50 and lengths[-1] >= 3 * mean, (p50, p90, lengths[-1])  # geometric: p90/p50 ~ 3.3
