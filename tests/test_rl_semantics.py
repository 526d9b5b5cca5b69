"""RL semantics at the edges: truncation, what is sampled, train mode, and the correctness guard's math.

Everything here runs in this process on the embedded model (no Ray, no vLLM): a few seconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rayppo.actors.generator import GeneratorEngine, SamplingSettings, stop_token_ids
from rayppo.config.derived import kl_limit, mismatch_limit, truncation_mode
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError, PPOConfig
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience import Experience, make_experience
from rayppo.learner.guard import LogprobMismatchError, MismatchGuard, WeightSyncError, check_weights
from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs, TruncationRule
from rayppo.learner.ppo import kl_penalty, truncation_targets
from rayppo.learner.rollout_tensors import RolloutTensors, padded
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.fingerprint import held_prints, probe_rows, sent_prints, split_rows
from rayppo.models.loading import Critic, load_causal_lm, prepare_for_training
from rayppo.models.sequences import critic_forward, pack
from rayppo.models.weights import SyncFault


# ------------------------------------------------------------------------------------------
# 1. Truncation: a cut row gets either V(S_T) or its score, never both
# ------------------------------------------------------------------------------------------
def test_truncation_targets_by_mode():
    scores, last_values = torch.tensor([0.8, 0.5]), torch.tensor([0.3, -0.2])
    truncated = torch.tensor([True, False])
    returned, bootstrap = truncation_targets(scores, last_values, truncated, "bootstrap")
    assert returned.tolist() == pytest.approx([0.0, 0.5]) and bootstrap.tolist() == pytest.approx([0.3, 0.0])
    returned, bootstrap = truncation_targets(scores, last_values, truncated, "terminal", missing_eos_penalty=0.25)
    assert returned.tolist() == pytest.approx([0.55, 0.5]) and bootstrap.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="truncation must be"):
        truncation_targets(scores, last_values, truncated, "nope")


@pytest.fixture(scope="module")
def critic(embedded_dir):
    return Critic.from_pretrained(embedded_dir).eval().requires_grad_(False)


def _one_row(tokenizer, reason: str) -> Rollout:
    response = tokenizer("7 7 3", add_special_tokens=False)["input_ids"]
    if reason == "stop":
        response.append(tokenizer.eos_token_id)
    n = len(response)
    rollout = Rollout([tokenizer("say 7 :")["input_ids"]], [response], [[-1.0 - 0.1 * t for t in range(n)]], [reason],
                      ["say 7 :"], ["7 7 3"], [0], [0])
    rollout.ref_logprobs = [[-1.2 + 0.05 * t for t in range(n)]]
    rollout.score = [0.8]
    return rollout


def _experience(rows: RolloutTensors, critic, beta: float, settings: ExperienceSettings) -> Experience:
    """``make_experience`` of ``rows`` as the learn step plans it (beta, T = 1)."""
    plan = UpdatePlan.decide(LearnSettings(settings), StepInputs(iteration=0, version=0, kl_coef=beta), rows)
    return make_experience(rows, critic, plan).experience


@pytest.mark.parametrize("reason", ["length", "stop"])
@pytest.mark.parametrize("mode", ["bootstrap", "terminal"])
def test_last_token_return_of_a_one_row_rollout(reason, mode, tokenizer, critic):
    """Wired through make_experience: a cut row's last-token return is -beta KL_T + V(S_T) under
    bootstrap and r_phi - beta KL_T under terminal; an EOS row is r_phi - beta KL_T under both."""
    rollout, beta = _one_row(tokenizer, reason), 0.1
    cfg = PPOConfig(whiten_advantages=False, gamma=1.0, lam=0.95)
    exp = _experience(RolloutTensors.of(rollout, tokenizer.pad_token_id), critic, beta,
                      ExperienceSettings(cfg, TruncationRule(mode)))
    kl_last = kl_penalty(torch.tensor(rollout.logprobs[0][-1]), torch.tensor(rollout.ref_logprobs[0][-1]))
    _, v_after = critic_forward(critic, pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id))
    if reason == "length" and mode == "bootstrap":
        expected = -beta * kl_last + v_after[0]
    else:
        expected = 0.8 - beta * kl_last
    last = len(rollout.response_ids[0]) - 1
    assert float(exp.returns[0, last]) == pytest.approx(float(expected.detach()), abs=1e-6)
    assert abs(float(v_after[0])) > 1e-3  # V(S_T) is not 0, so dropping the bootstrap would fail this test


def test_truncation_config_is_checked():
    # bootstrap (a cut is a time limit) is the default with a critic; without one there is no V(S_T).
    assert truncation_mode(load_config(None, [])) == "bootstrap"
    assert truncation_mode(load_config(None, ["ppo.advantage=grpo", "rollout.samples_per_prompt=2"])) == "terminal"
    with pytest.raises(ConfigError, match="rollout.truncation: must be auto, bootstrap or terminal"):
        load_config(None, ["rollout.truncation=cut"])
    with pytest.raises(ConfigError, match="rollout.missing_eos_penalty: applies only with rollout.truncation=terminal"):
        load_config(None, ["rollout.missing_eos_penalty=0.5"])
    assert load_config(None, ["rollout.truncation=terminal", "rollout.missing_eos_penalty=0.5"])
    with pytest.raises(ConfigError, match=r"rollout.truncation: bootstrap needs a critic's V\(S_T\), and "
                                          r"ppo.advantage=rloo trains none"):
        load_config(None, ["rollout.truncation=bootstrap", "ppo.advantage=rloo", "rollout.samples_per_prompt=2"])


# ------------------------------------------------------------------------------------------
# 2-3. What is sampled is what is scored
# ------------------------------------------------------------------------------------------
def test_top_p_below_one_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"rollout.top_p: must be 1.0: nucleus sampling renormalises"):
        load_config(None, ["rollout.top_p=0.9"])


def test_hf_backend_ignores_the_models_sampling_settings(embedded_dir, tokenizer, copy_model):
    """A shipped generation_config with a repetition penalty and a no-repeat rule must not change
    what is sampled (the recorded log-probs would not show it): same seed, same responses."""
    shaped = str(copy_model("penalised", repetition_penalty=10.0, no_repeat_ngram_size=1))
    sampling = SamplingSettings(max_new_tokens=8, temperature=1.0)
    prompts = PromptBatch(["say 7 :"] * 8, [tokenizer("say 7 :")["input_ids"]] * 8)
    plain = GeneratorEngine(str(embedded_dir), sampling, backend="hf").generate(prompts, seed=3)
    penalised = GeneratorEngine(shaped, sampling, backend="hf").generate(prompts, seed=3)
    assert penalised.response_ids == plain.response_ids
    # The digits task repeats digits: a no-repeat rule would have changed these responses.
    assert any(len(set(ids)) < len(ids) for ids in plain.response_ids)


def test_hf_backend_stops_on_the_generation_configs_eos_ids(tokenizer, copy_model):
    """(vLLM's side: tests/test_vllm_sampling.py.)"""
    seven = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    folder = str(copy_model("two_eos", eos_token_id=[tokenizer.eos_token_id, seven]))
    assert stop_token_ids(tokenizer, folder) == sorted([tokenizer.eos_token_id, seven])
    engine = GeneratorEngine(folder, SamplingSettings(max_new_tokens=8), backend="hf")
    rollout = engine.generate(PromptBatch(["say 7 :"] * 8, [tokenizer("say 7 :")["input_ids"]] * 8), seed=0)
    for ids, reason in zip(rollout.response_ids, rollout.finish_reason):
        assert seven not in ids[:-1] and tokenizer.eos_token_id not in ids[:-1]
        assert (reason == "stop") == (ids[-1] in (seven, tokenizer.eos_token_id))
    assert any(ids[-1] == seven for ids in rollout.response_ids)  # "say 7" writes 7s: some rows stop on it


# ------------------------------------------------------------------------------------------
# 4. Train mode without dropout; gradient checkpointing that is really on
# ------------------------------------------------------------------------------------------
def test_trained_models_are_in_train_mode_without_dropout(embedded_dir, tmp_path):
    config = json.loads((embedded_dir / "config.json").read_text())
    folder = tmp_path / "dropout"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    (folder / "model.safetensors").write_bytes((embedded_dir / "model.safetensors").read_bytes())
    model = prepare_for_training(load_causal_lm(folder), gradient_checkpointing=False)
    assert model.training
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second)  # no dropout: the first PPO ratio is exactly 1
    torch.testing.assert_close(first, model.eval()(ids).logits, atol=0, rtol=0)


def _counted(forward, calls: list[int]):
    """``forward`` that appends to ``calls`` each time it runs."""
    def wrapper(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_recomputes_every_layer_in_backward(embedded_dir, checkpointing):
    for model in (load_causal_lm(embedded_dir), Critic.from_pretrained(embedded_dir)):
        prepare_for_training(model, checkpointing)
        layers = [m for name, m in model.named_modules() if name.endswith("layers.0") or name.endswith("layers.1")]
        calls = []
        for layer in layers:  # count calls of the layers' forward (hooks do not fire on a recompute)
            layer.forward = _counted(layer.forward, calls)
        ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
        out = model(ids).logits if hasattr(model, "lm_head") else model(ids, torch.ones_like(ids), torch.arange(6)[None])
        forward_calls = len(calls)
        out.float().sum().backward()
        assert forward_calls == len(layers) == 2
        # With checkpointing each layer's forward runs again during backward.
        assert len(calls) == (2 * forward_calls if checkpointing else forward_calls)


# ------------------------------------------------------------------------------------------
# 7. The correctness guard's math
# ------------------------------------------------------------------------------------------
def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(8, 16, generator=g) * 0.02, "k": torch.randn(4, 16, generator=g) * 0.02,
            "norm": 1 + 0.01 * torch.randn(16, generator=g), "embed": torch.randn(30, 16, generator=g)}


def test_fingerprints_of_an_exact_copy_match_and_survive_fusion_and_padding():
    state = _state()
    sent = sent_prints(state)
    assert check_weights(sent, held_prints(state), generator=0, version=1) == 4
    # The engine fused q and k into one matrix and padded the vocabulary with rows of zeros.
    fused = torch.cat([state["q"], state["k"]])
    shapes = {k: list(v.shape) for k, v in state.items()}
    held = split_rows(probe_rows(fused), ["q", "k"], shapes)
    padded = torch.cat([state["embed"], torch.zeros(34, 16)])
    held |= split_rows(probe_rows(padded), ["embed"], shapes)
    with pytest.raises(WeightSyncError, match=r"reports fingerprints of 3 of the 4 sent tensors, not of norm "):
        check_weights(sent, held, generator=0, version=1)  # a tensor not fingerprinted is not verified
    held |= held_prints({"norm": state["norm"]})
    assert check_weights(sent, held, generator=0, version=1) == 4


def test_weight_check_names_generator_tensor_and_version():
    state = _state()
    sent = sent_prints(state)
    broken = dict(SyncFault("perturb_tensor", "norm").apply(state.items()))
    with pytest.raises(WeightSyncError, match=r"policy version 4 \(the update of iteration 3\): generator 1 does not hold .*: norm \(\|held - sent\|"):
        check_weights(sent, held_prints(broken), generator=1, version=4)
    with pytest.raises(WeightSyncError, match="holds none of the 4 sent tensors"):
        check_weights(sent, {}, generator=0, version=4)
    assert "k" not in dict(SyncFault("skip_tensor", "k").apply(state.items()))


def test_mismatch_guard_names_iteration_and_generator():
    gap = torch.tensor([[1e-6, 0.0], [2e-3, 1e-5], [5e-4, 0.0]])
    guard = MismatchGuard(limit=1e-3, iteration=7)
    with pytest.raises(LogprobMismatchError, match=r"iteration 7: logprob_mismatch/max = 0.002 .* on generator 5"):
        guard.check(gap, torch.tensor([0, 5, 1]), LocalCollective())
    MismatchGuard(limit=1e-2, iteration=7).check(gap, torch.tensor([0, 5, 1]), LocalCollective())  # under: passes
    assert mismatch_limit(load_config(None, []).checks, "float32") == 1e-3
    assert mismatch_limit(load_config(None, []).checks, "bfloat16") == math.inf  # the k3 mean is the bf16 check
    assert kl_limit(load_config(None, []).checks, "bfloat16") == 1e-2 and kl_limit(load_config(None, []).checks, "float32") == 1e-6


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_tied_rewards_gets_only_its_kl_reward_to_go_under_kl_mode_reward(estimator, tokenizer):
    """Every response of a group scores 0.5 (all equally right or wrong) but their KL to pi_ref
    differs, as numeric noise makes it at iteration 0: the group step must see the tied task score
    (advantage 0), and the KL enter each token as -beta sum_{k>=t} KL_k alone. Grouping
    r_i - beta sum_t KL_t instead gave every row |A| ~ 1 (GRPO divides the KL differences by
    their own std): the first updates trained on noise."""
    beta, rows = 0.05, 4
    response = tokenizer("7 7 3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(response)
    rollout = Rollout([tokenizer("say 7 :")["input_ids"]] * rows, [response] * rows,
                      [[-1.0 - 0.1 * t for t in range(n)] for _ in range(rows)], ["stop"] * rows, ["say 7 :"] * rows,
                      ["7 7 3"] * rows, [0] * rows, [0] * rows, group_id=[0] * rows)
    rollout.ref_logprobs = [[-1.0 - 0.1 * t + 1e-5 * (i + 1) * (t + 1) for t in range(n)] for i in range(rows)]
    rollout.score = [0.5] * rows
    cfg = PPOConfig(advantage=estimator, kl_mode="reward")
    exp = _experience(RolloutTensors.of(rollout, tokenizer.pad_token_id), None, beta,
                      ExperienceSettings(cfg, TruncationRule("terminal")))
    kl = kl_penalty(padded(rollout.logprobs), padded(rollout.ref_logprobs))  # [rows, n], k1
    to_go = -beta * kl.flip(-1).cumsum(-1).flip(-1)
    assert torch.allclose(exp.advantages, to_go.to(exp.advantages.dtype), rtol=0, atol=1e-9)
    assert float(exp.advantages.abs().max()) <= beta * float(kl.sum(-1).abs().max()) + 1e-12  # no unit advantages


def test_the_entropy_bonus_is_aggregated_as_the_loss_is(tokenizer, embedded_dir):
    """Under seq-mean-token-mean every row's entropy weighs the same, as its loss does: the bonus
    is c x (mean over rows of each row's token mean), not the token mean (which weighs long rows
    more). Two rows of 4 and 2 tokens make the two differ."""
    from rayppo.learner.minibatches import MicroBatch
    from rayppo.learner.objectives import policy_objective
    from rayppo.models.loading import load_causal_lm
    from rayppo.models.sequences import policy_forward

    policy = load_causal_lm(embedded_dir).double()
    rows = [tokenizer("7 7 3 1", add_special_tokens=False)["input_ids"], tokenizer("7 7", add_special_tokens=False)["input_ids"]]
    rollout = Rollout([tokenizer("say 7 :")["input_ids"]] * 2, rows, [[-1.0] * len(r) for r in rows], ["length"] * 2,
                      ["say 7 :"] * 2, ["r"] * 2, [0, 0], [0, 0])
    rollout.score = [1.0, 0.0]
    objectives = {}
    for c in (0.0, 0.1):
        cfg = PPOConfig(loss_agg="seq-mean-token-mean", entropy_coef=c, whiten_advantages=False)
        tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
        settings = LearnSettings(ExperienceSettings(cfg, TruncationRule("terminal")))
        plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.0), tensors)
        part = make_experience(tensors, None, plan).experience.micro(torch.arange(2))
        objectives[c], *_ = policy_objective(policy, part, MicroBatch(torch.arange(2), 1.0, 1.0), plan)
        _, entropy = policy_forward(policy, part.batch, with_entropy=True)
        mask = part.batch.mask
    row_means = (entropy * mask).sum(-1) / mask.sum(-1)
    assert float(objectives[0.0] - objectives[0.1]) == pytest.approx(0.1 * float(row_means.mean()), rel=1e-9)
    assert abs(float(row_means.mean()) - float((entropy * mask).sum() / mask.sum())) > 1e-3  # the two differ here
