"""Multi-turn episodes (docs/multi-turn.md): the tokens trained on are the ones
sampled plus the observation ids, masks and log-probs line up, values and advantages skip the
environment's tokens, and a hanging or crashing environment is named within its deadline."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import pytest
import torch

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError, PPOConfig
from rayppo.data.prompts import load_prompt_set, read_prompt_rows
from rayppo.data.rollout import Rollout
from rayppo.episodes.environment import EnvironmentFailedError, EnvironmentPool, Episode
from rayppo.episodes.turn_loop import EpisodeSettings, episode_stats
from rayppo.learner.experience import Experience, make_experience
from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs, TruncationRule
from rayppo.learner.rollout_tensors import RolloutTensors, padded
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.chat_tokens import TemplateError, check_template, observation_ids
from rayppo.models.embedded_guess import build_chat_tokenizer
from rayppo.models.loading import load_causal_lm
from rayppo.models.sequences import pack, policy_forward
from rayppo.plan.reward_check import check_environment
from rayppo.tasks import guess

GUESS = "rayppo.tasks.guess:HigherLower"


# ------------------------------------------------------------------------------ the MDP on the record
class ColumnCritic(torch.nn.Module):
    """V(S) read from a table by column: ``values[b, c]`` for the state after column c."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask=None, position_ids=None):  # noqa: ANN001 - the critic's call
        return self.table[:, : input_ids.shape[1]]


def _experience(rows: RolloutTensors, critic, beta: float, settings: ExperienceSettings) -> Experience:
    """``make_experience`` of ``rows`` as the learn step plans it (beta, T = 1)."""
    plan = UpdatePlan.decide(LearnSettings(settings), StepInputs(iteration=0, version=0, kl_coef=beta), rows)
    return make_experience(rows, critic, plan).experience


def _two_turn_rollout(finish: str) -> Rollout:
    # prompt [1, 2] | turn 1: a0 a1 | observation: o2 o3 | turn 2: a4
    return Rollout(prompt_ids=[[1, 2]], response_ids=[[5, 6, 7, 8, 9]], logprobs=[[-0.5, -1.0, 0.0, 0.0, -0.25]],
                   finish_reason=[finish], prompt_text=["p"], response_text=["r"], policy_version=[0],
                   ref_logprobs=[[-0.75, -0.5, -3.0, -4.0, -0.5]], score=[2.0], action_mask=[[1, 1, 0, 0, 1]],
                   turn_ends=[[1, 4]], turn_rewards=[[0.5, 1.0]])


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_two_turn_episodes_advantages_step_over_the_observation(finish):
    gamma, lam, beta = 0.9, 0.8, 0.1
    table = torch.tensor([[0.0, 0.3, 0.6, 9.0, 9.0, 1.5, 1.8]])  # columns 3, 4: V at the observation tokens
    cfg = PPOConfig(gamma=gamma, lam=lam, whiten_advantages=False)
    exp = _experience(RolloutTensors.of(_two_turn_rollout(finish), 0), ColumnCritic(table), beta,
                      ExperienceSettings(cfg, TruncationRule("bootstrap")))
    # Response token t is predicted at column P - 1 + t = 1 + t: V at the actions t = 0, 1, 4.
    v0, v1, v4, v_end = 0.3, 0.6, 1.5, 1.8
    kl = [(-0.5 + 0.75), (-1.0 + 0.5), (-0.25 + 0.5)]
    score = 2.0 if finish == "stop" else 0.0  # a cut episode: no score, V(S_T) bootstraps
    bootstrap = 0.0 if finish == "stop" else v_end
    r0, r1, r4 = -beta * kl[0], -beta * kl[1] + 0.5, -beta * kl[2] + 1.0 + score
    d4 = r4 + gamma * bootstrap - v4
    d1 = r1 + gamma * v4 - v1  # V_next of turn 1's last action: the next turn's first action's value
    d0 = r0 + gamma * v1 - v0
    a4 = d4
    a1 = d1 + gamma * lam * a4
    a0 = d0 + gamma * lam * a1
    expected = torch.tensor([[a0, a1, 0.0, 0.0, a4]], dtype=torch.float64)
    # fp32 arithmetic on values below 3, about ten operations a token: rounding below 1e-6.
    torch.testing.assert_close(exp.advantages.double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(exp.returns.double(), expected + torch.tensor([[v0, v1, 0, 0, v4]]) * (expected != 0),
                               atol=1e-6, rtol=0)
    assert exp.rewards[0, 2:4].abs().max() == 0  # no KL and no reward on the environment's tokens
    assert exp.batch.mask.tolist() == [[1, 1, 0, 0, 1]]


def test_a_group_estimator_takes_an_episode_as_one_sample():
    # Two episodes of one group: returns 0.5 + 1.0 + 2.0 = 3.5 and 0.0 (turn rewards, no score).
    first = _two_turn_rollout("stop")
    second = Rollout.concat([first])
    second.turn_rewards, second.score = [[0.0, 0.0]], [0.0]
    both = Rollout.concat([first, second])
    both.group_id, both.ref_logprobs = [0, 0], []
    exp = _experience(RolloutTensors.of(both, 0), None, 0.0, ExperienceSettings(PPOConfig(advantage="grpo", kl_mode="loss")))
    # GRPO: (r_i - mean) / std over the group's two returns, 3.5 and 0: +-1.75 / (1.75 sqrt 2) (unbiased std).
    a = 2 ** -0.5
    expected = torch.tensor([[a, a, 0.0, 0.0, a], [-a, -a, 0.0, 0.0, -a]])
    torch.testing.assert_close(exp.advantages, expected, atol=1e-6, rtol=0)


def test_a_single_turn_row_with_an_all_ones_action_mask_trains_exactly_as_without_one():
    plain = Rollout(prompt_ids=[[1, 2], [3]], response_ids=[[5, 6, 7], [8]], logprobs=[[-0.5, -1.0, -0.2], [-0.1]],
                    finish_reason=["stop", "length"], prompt_text=["a", "b"], response_text=["", ""],
                    policy_version=[0, 0], ref_logprobs=[[-0.7, -0.5, -0.3], [-0.4]], score=[1.0, 0.5])
    masked = Rollout.concat([plain])
    masked.action_mask, masked.turn_ends, masked.turn_rewards = [[1, 1, 1], [1]], [[2], [0]], [[0.0], [0.0]]
    table = torch.tensor([[0.1, 0.2, 0.4, 0.8, 1.6, 3.2]] * 2)
    cfg = PPOConfig(gamma=0.95, lam=0.9)
    a = _experience(RolloutTensors.of(plain, 0), ColumnCritic(table), 0.05, ExperienceSettings(cfg))
    b = _experience(RolloutTensors.of(masked, 0), ColumnCritic(table), 0.05, ExperienceSettings(cfg))
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)


# ------------------------------------------------------------------------------- token-in, token-out
def _tokenizer(template: str):
    tok = build_chat_tokenizer([" ".join(guess.DIGITS), " ".join(guess.WORDS)])
    tok.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    tok.chat_template = template
    return tok


def test_an_observation_is_the_templates_tokens_and_keeps_the_boundary_the_policy_never_samples():
    # The template closes every turn with <|sep|> after the end-of-turn token (as Qwen adds a newline
    # after <|im_end|>): the policy stops at <|end|>, so <|sep|> must open the observation.
    tok = _tokenizer("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|><|sep|>"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ids = observation_ids(tok, guess.conversation(), "<|end|>", {"role": "user", "content": "higher"})
    assert tok.convert_ids_to_tokens(ids) == ["<|sep|>", "<|user|>", "▁higher", "<|end|>", "<|sep|>", "<|assistant|>"]


def test_a_template_that_drops_the_turns_text_is_refused():
    # Assistant turns followed by another message are rendered without their content: the sampled
    # tokens would not be the rendered ones.
    tok = _tokenizer("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
                     "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}<|end|>"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(TemplateError, match="does not render an assistant turn as its text followed by"):
        check_template(tok, ["<|end|>"], "user")


# The rendering rules of three families' official chat templates, written here as Jinja of our own
# (the official ones are public: Llama 3's in Meta-Llama-3-8B-Instruct, Qwen2.5's and Qwen3's in
# their tokenizer_config.json): Llama 3 trims every message; Qwen2.5 is ChatML with a default
# system message and tool replies in <tool_response> blocks of a user turn; Qwen3 also renders
# an empty <think> block into an assistant turn that is the last message after the latest user
# query, splits reasoning off at </think> and keeps it only after that query.
TEMPLATES = {
    "llama3": ("<|eot_id|>", "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
               "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2.5": ("<|im_end|>", "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
                "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}"
                "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
                "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
                "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
                "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "qwen3": ("<|im_end|>", "{% set ns = namespace(last_query=messages | length - 1) %}"
              "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}"
              "{% endfor %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
              "{% set content = m['content'] %}{% set reasoning = '' %}{% if '</think>' in content %}"
              "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
              "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
              "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
              "<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content }}<|im_end|>\n"
              "{% else %}<|im_start|>assistant\n{{ content }}<|im_end|>\n{% endif %}"
              "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
              "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
SEPARATORS = {  # what each template writes between a turn's end-of-turn token and the next turn
    ("llama3", "user"): "<|start_header_id|>user<|end_header_id|>\n\nhigher<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("qwen2.5", "tool"): "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ("qwen3", "user"): "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
    ("qwen3", "tool"): "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.parametrize("name, role", sorted(SEPARATORS))
def test_real_templates_that_rewrite_turns_give_observation_tokens_whatever_was_sampled(name, role):
    """Sampled turns with surrounding spaces (Llama 3 trims them) and with a reasoning block (Qwen3
    strips it from turns before the latest query, and renders the last turn with an empty one):
    the observation's tokens are the template's separator in every case, turn after turn. Rendering
    the sampled text instead refused these turns mid-run after the start-up probe had passed."""
    end, template = TEMPLATES[name]
    tok = _tokenizer(template)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                         "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                                         "<tool_response>", "</tool_response>"]})
    assert check_template(tok, [end], role) == [end]
    expected = tok(SEPARATORS[name, role], add_special_tokens=False)["input_ids"]
    history = [{"role": "user", "content": "guess a digit"}]
    for sampled in ["5", " 5 \n", "<think>\nlower than 7\n</think>\n\n5", "6"]:
        observation = {"role": role, "content": "higher"}
        assert observation_ids(tok, history, end, observation) == expected, sampled
        history += [{"role": "assistant", "content": sampled}, observation]


def test_a_tokenizer_without_a_chat_template_is_refused():
    tok = _tokenizer("")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="needs a policy tokenizer with a chat template"):
        check_template(tok, ["<|end|>"], "user")


def _replayed_observations(tok, rollout: Rollout, row: int) -> tuple[list[int], list[int]]:
    """Row ``row``'s action tokens and observation tokens as an independent replay of the game makes them."""
    secret = rollout.row_fields()[row]["secret"]
    env, history = guess.HigherLower("", secret), guess.conversation()
    ids, mask = rollout.response_ids[row], rollout.action_mask[row]
    start, actions, observations = 0, [], []
    for end in rollout.turn_ends[row]:
        turn = ids[start : end + 1]
        actions += turn
        text = tok.decode(turn[:-1], skip_special_tokens=False)
        observation, _, done = env.step(text)
        if done or end + 1 == len(ids):
            break
        message = {"role": "user", "content": observation}
        added = observation_ids(tok, history, "<|end|>", message)
        history += [{"role": "assistant", "content": text}, message]
        observations += added
        start = end + 1 + len(added)
        assert mask[end + 1 : start] == [0] * len(added)
    return actions, observations


@pytest.fixture(scope="module", params=["hf", "vllm"])
def player(request, guess_dir):
    """A generator of either backend playing the guessing game, and 24 of its prompts."""
    settings = EpisodeSettings(GUESS, max_turns=guess.MAX_TURNS, max_tokens=40, timeout_s=30, workers=2)
    engine = GeneratorEngine(str(guess_dir), SamplingSettings(40, 1.0), backend=request.param, episodes=settings,
                             actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    prompts = load_prompt_set("embedded-guess", "prompt", engine.tokenizer, 24).select(range(24))
    yield engine, prompts
    engine.close()


def test_the_tokens_trained_on_are_the_sampled_ids_plus_the_observation_ids(player, guess_dir):
    engine, prompts = player
    sampled: list[list[list[int]]] = []
    backend_sample = engine.backend.sample

    def recording(contexts, settings, seeds, limits=None):  # the real sampler, its answers kept
        out = backend_sample(contexts, settings, seeds, limits)
        sampled.append(out[0])
        return out

    engine.backend.sample = recording
    try:
        rollout = engine.generate(prompts, seed=3)
    finally:
        engine.backend.sample = backend_sample
    tok = engine.tokenizer
    assert max(len(t) for t in rollout.turn_ends) >= 3  # real multi-turn play, not one turn each
    for row in range(len(rollout)):
        ids, mask = rollout.response_ids[row], rollout.action_mask[row]
        actions, observations = _replayed_observations(tok, rollout, row)
        # Turn k of row i was answer i' of call k, i' counting only the rows still playing then.
        assert [t for t, m in zip(ids, mask) if m] == actions
        assert [t for t, m in zip(ids, mask) if not m] == observations
        assert all(lp == 0.0 for lp, m in zip(rollout.logprobs[row], mask) if not m)
        assert len(rollout.turn_rewards[row]) == len(rollout.turn_ends[row])
    calls = [[ids for ids in call] for call in sampled]
    assert sum(len(call) for call in calls) == sum(len(t) for t in rollout.turn_ends)
    # The recorded log-probs are the policy's on the whole episode, read in one forward pass.
    batch = pack(rollout.prompt_ids, rollout.response_ids, tok.pad_token_id, rollout.action_mask)
    with torch.no_grad():
        logprobs, _ = policy_forward(load_causal_lm(str(guess_dir), "float32").eval(), batch)
    gap = ((logprobs - padded(rollout.logprobs)).abs() * batch.mask).max()
    # fp32 forwards of other batch layouts (HF); vLLM's CPU kernels are not the transformers ones.
    bound = 2e-4 if engine.describe().startswith("vLLM") else 2e-5
    assert gap < bound, f"log-prob mismatch {gap:.2e} on multi-turn rows"


def test_solved_episodes_end_with_the_right_guess_and_their_turn_rewards_add_up(player):
    engine, prompts = player
    rollout = engine.generate(prompts, seed=5)
    for row, reason in enumerate(rollout.finish_reason):
        if reason == "stop":  # solved: the environment said done on the last turn
            assert rollout.turn_rewards[row][-1] == 1.0
            assert rollout.total_rewards()[row] == pytest.approx(guess.solved_return(len(rollout.turn_ends[row])))
        assert rollout.turn_ends[row][-1] == len(rollout.response_ids[row]) - 1  # an episode ends on an action


def test_an_episode_past_its_seconds_is_cut_after_its_turn_not_after_an_observation(player):
    engine, prompts = player
    settings = engine.episodes
    engine.episodes = dataclasses.replace(settings, max_seconds=1e-9)  # over as soon as the first turn is sampled
    try:
        rollout = engine.generate(prompts, seed=7)
    finally:
        engine.episodes = settings
    assert all(len(ends) == 1 for ends in rollout.turn_ends)
    assert all(all(rollout.action_mask[i]) for i in range(len(rollout)))  # no observation was appended
    assert {r for r, rewards in zip(rollout.finish_reason, rollout.turn_rewards) if rewards != [1.0]} == {"length"}


# ---------------------------------------------------------------------------------- faulty environments
FAULTY = '''
import os, time

class Hangs:
    def __init__(self, prompt):
        pass
    def step(self, action):
        time.sleep(3600)

class Crashes:
    def __init__(self, prompt):
        pass
    def step(self, action):
        os._exit(3)

class Raises:
    def __init__(self, prompt):
        pass
    def step(self, action):
        raise ValueError("the tool broke")

class Wrong:
    def __init__(self, prompt):
        pass
    def step(self, action):
        return "fine"
'''


@pytest.mark.parametrize("name, message", [
    ("Hangs", "ran past rollout.environment_timeout_s=1 s; its process was killed"),
    ("Crashes", "exited with code 3"),
    ("Raises", "failed: ValueError: the tool broke"),
    ("Wrong", "failed: TypeError: step returned 'fine'; expected"),
])
def test_a_faulty_environment_step_is_named_within_its_deadline(tmp_path, monkeypatch, name, message):
    (tmp_path / "faulty_env.py").write_text(FAULTY)
    monkeypatch.chdir(tmp_path)
    pool = EnvironmentPool(f"faulty_env:{name}", 2, timeout_s=1.0)
    try:
        episodes = [Episode(i, f"prompt {i}", {}, None) for i in range(3)]
        pool.start(episodes)
        start = time.monotonic()
        results = pool.step(episodes, ["5"] * 3, turn=1)
        seconds = time.monotonic() - start
    finally:
        pool.close()
    assert all(isinstance(r, EnvironmentFailedError) for r in results)
    assert message in str(results[0]) and "prompt 'prompt 0'" in str(results[0]) and "turn 1" in str(results[0])
    if name in ("Hangs", "Crashes"):  # episode 2 lived in episode 0's process (2 workers): lost with it
        assert "lost with its process, which ended on prompt 'prompt 0'" in str(results[2])
    else:
        assert message in str(results[2])
    # The two workers run at once, each killed at its deadline: one deadline and start-up slack.
    assert seconds < 1.0 + 3.0


def test_a_hanging_environment_ends_its_episodes_with_the_timeout_reward(guess_dir, tmp_path, monkeypatch):
    (tmp_path / "faulty_env.py").write_text(FAULTY)
    monkeypatch.chdir(tmp_path)
    settings = EpisodeSettings("faulty_env:Hangs", max_turns=3, max_tokens=40, timeout_s=0.5, timeout_reward=-1.0,
                               workers=2)
    engine = GeneratorEngine(str(guess_dir), SamplingSettings(40, 1.0), backend="hf", episodes=settings)
    prompts = load_prompt_set("embedded-guess", "prompt", engine.tokenizer, 24).select(range(4))
    start = time.monotonic()
    rollout = engine.generate(prompts, seed=0)
    engine.close()
    # Every episode's first step hangs: each ends there with the timeout reward, as done.
    assert rollout.turn_rewards == [[-1.0]] * 4 and rollout.finish_reason == ["stop"] * 4
    assert time.monotonic() - start < 2 * 0.5 + 5.0  # two workers, each killed once at its deadline
    strict = GeneratorEngine(str(guess_dir), SamplingSettings(40, 1.0), backend="hf",
                             episodes=EpisodeSettings("faulty_env:Hangs", timeout_s=0.5, max_tokens=40))
    try:
        with pytest.raises(EnvironmentFailedError, match="faulty_env:Hangs"):
            strict.generate(prompts, 0)
    finally:
        strict.close()


# -------------------------------------------------------------------------------------- configuration
def test_an_environment_replaces_the_default_reward_and_its_budgets_are_checked():
    cfg = load_config(None, [f"rollout.environment={GUESS}"])
    assert cfg.reward.function is None  # the turn rewards are the reward
    with pytest.raises(ConfigError, match="rollout.partial_tokens: cannot cut the turns"):
        load_config(None, [f"rollout.environment={GUESS}", "rollout.partial_tokens=4", "rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.ignore_eos"):
        load_config(None, [f"rollout.environment={GUESS}", "rollout.ignore_eos=true"])
    with pytest.raises(ConfigError, match="rollout.max_turns: must be >= 1"):
        load_config(None, [f"rollout.environment={GUESS}", "rollout.max_turns=0"])
    with pytest.raises(ConfigError, match="none only with rollout.environment"):
        load_config(None, ["reward.function=null"])
    kept = load_config(None, [f"rollout.environment={GUESS}", "reward.function=rayppo.tasks.digits:reward"])
    assert kept.reward.function == "rayppo.tasks.digits:reward"


def test_an_environment_that_cannot_start_from_the_rows_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from rayppo.plan.inputs import check_inputs

    (tmp_path / "needs_label.py").write_text("class Env:\n    def __init__(self, prompt, label):\n        pass\n"
                                             "    def step(self, action):\n        return None, 0.0, True\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["rollout.environment=needs_label:Env", "data.prompts=embedded-guess",
                             "model.policy=embedded-guess"])
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"rollout.environment: needs_label:Env\(prompt, label\) cannot be called on "
                                          r"embedded guessing game row 1: missing a required argument: 'label'"):
        check_inputs(cfg)
    assert time.monotonic() - start < 5.0


def test_the_aimless_warm_up_and_bisection_take_the_turns_the_task_says():
    assert guess.expected_turns(0, 9, bisect=False) == pytest.approx(3.4437, abs=1e-4)
    assert guess.expected_turns(0, 9, bisect=True) == pytest.approx(2.9)
    rng = random.Random(0)
    games = [guess.aimless_game(rng.randrange(10), rng) for _ in range(4000)]
    assert sum(len(g) for g in games) / len(games) == pytest.approx(3.44, abs=0.06)  # 4000 games: sd of mean ~0.02


# ------------------------------------------------------------------------------------ the tool example
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_calculator_tool_answers_refuses_and_scores_in_its_own_process(monkeypatch):
    monkeypatch.chdir(EXAMPLES)  # where the example's config says to run it from
    cfg = load_config(EXAMPLES / "calculator.yaml", ["model.policy=embedded"])
    rows = read_prompt_rows(cfg.data.prompts, "prompt")
    check_environment(cfg.rollout.environment, rows, cfg.rollout.environment_timeout_s)
    pool = EnvironmentPool(cfg.rollout.environment, 2, timeout_s=cfg.rollout.environment_timeout_s)
    try:
        episodes = [Episode(i, "q", rows.fields[i], rows.prompts[i]) for i in range(2)]
        pool.start(episodes)
        start = time.monotonic()
        first = pool.step(episodes, ["calc: 1234 * 5678", "calc: 9 ** 9 ** 9"], turn=1)
        assert time.monotonic() - start < 5.0  # the huge power is refused, not computed
        # An overflow and a result too long to print are the policy's mistakes: observations, not
        # the environment's failure (which would stop the run).
        mistakes = pool.step(episodes, ["calc: 1e200 ** 2", "calc: (10 ** 64) ** 64 * (10 ** 64) ** 4"], turn=2)
        second = pool.step(episodes, ["answer: 7006652", "answer: 1"], turn=3)
    finally:
        pool.close()
    assert (first[0].observation, first[0].reward, first[0].done) == ("7006652", 0.0, False)
    assert first[1].observation.startswith("error: exponent") and not first[1].done
    assert mistakes[0].observation.startswith("error: result out of range") and not mistakes[0].done
    assert mistakes[1].observation == "error: the result has too many digits to show" and not mistakes[1].done
    assert [(s.reward, s.done) for s in second] == [(1.0, True), (0.0, True)]


# ------------------------------------------------------------------------ distributed == in-process
MULTI_TURN = ["model.policy=embedded-guess", "data.prompts=embedded-guess", f"rollout.environment={GUESS}",
              "rollout.max_turns=6", "rollout.max_new_tokens=40", "rollout.batch_size=16", "ppo.epochs=2",
              "ppo.minibatches=2", "generators.backend=hf", "generators.num=1", "eval.every=0"]


@pytest.mark.slow
def test_two_learner_ranks_train_on_multi_turn_rows_as_the_in_process_trainer_does(guess_dir):
    """One iteration of the guessing game (4 optimiser steps): the episodes (same seeds, same
    weights), losses, KL and clip fraction of 2 DeepSpeed ranks (ZeRO-2, each minibatch in
    micro-batches of 24 tokens, rows dealt by tokens) equal the single-process trainer's, which
    takes each minibatch whole. (A second iteration would sample from weights that may differ by
    Adam's step bound where a gradient is at rounding noise, test_distributed.py's BULK_GAP, and an
    episode of many draws can then go another way.)"""
    from rayppo.trainers.distributed import DistributedTrainer
    from rayppo.trainers.inprocess import InProcessTrainer

    reference = InProcessTrainer(load_config(None, MULTI_TURN + ["trainer=reference", "learner.micro_batch_tokens=0"]))
    expected = reference.iteration()
    trainer = DistributedTrainer(load_config(None, MULTI_TURN + ["learner.num_ranks=2", "learner.zero_stage=2",
                                                                 "learner.micro_batch_tokens=24"]))
    try:
        got = trainer.iteration()
        rollout = trainer.last_rollout
    finally:
        trainer.close()
    assert rollout.response_ids == reference.last_rollout.response_ids
    assert rollout.action_mask == reference.last_rollout.action_mask
    assert max(len(t) for t in rollout.turn_ends) >= 3 and expected["policy/clipfrac"] > 0
    for key in ("policy/loss", "value/loss", "policy/clipfrac", "policy/approx_kl", "entropy", "reward/mean",
                "value/explained_variance", "episode/turns_mean"):
        # Float32 sums in another order over 2 ranks and micro-batches (test_distributed's bound).
        assert got[key] == pytest.approx(expected[key], abs=1e-5, rel=1e-4), key


def test_the_episode_figures_count_turns_tokens_and_each_budgets_cuts():
    # Three episodes: solved in 2 turns; cut at max_turns=3; cut inside its second turn (tokens).
    masks = [[1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 1]]
    ends = [[1, 5], [1, 4, 7], [1, 4]]
    stats = episode_stats(masks, ends, ["stop", "length", "length"], 3, [0.5, 1.0, 0.0])
    assert stats["episode/turns_mean"] == pytest.approx(7 / 3) and stats["episode/turns_max"] == 3
    assert stats["episode/action_tokens_mean"] == pytest.approx(13 / 3)
    assert stats["episode/observation_tokens_mean"] == pytest.approx(6 / 3)
    assert (stats["episode/cut_frac"], stats["episode/cut_by_turns_frac"], stats["episode/cut_by_budget_frac"]) == \
        pytest.approx((2 / 3, 1 / 3, 1 / 3))
    assert stats["episode/environment_seconds_mean"] == pytest.approx(0.5)


@pytest.mark.slow
def test_the_asynchronous_pipeline_trains_on_episodes(guess_dir, tmp_path):
    """rollout.max_staleness=1: generators play the next batch's episodes while the learner trains;
    every row is an episode of one policy version, and the iterations' figures count its turns."""
    from rayppo.trainers.distributed import DistributedTrainer

    cfg = load_config(None, MULTI_TURN + ["rollout.max_staleness=1", "learner.weight_sync=object_store",
                                          f"output.dir={tmp_path / 'run'}"])
    trainer = DistributedTrainer(cfg)
    try:
        stats = [trainer.iteration() for _ in range(3)]
        rollout = trainer.last_rollout
    finally:
        trainer.close()
    assert all(s["episode/turns_mean"] > 1 for s in stats)
    assert rollout.action_mask and all(len(m) == len(ids) for m, ids in zip(rollout.action_mask, rollout.response_ids))
    assert max(s["async/staleness_max"] for s in stats) <= 1 and sum(s["async/dropped_rows"] for s in stats) == 0


HANGS_ON = '''
import time

class HangsOn:
    """Answers every action but 'hang', on which it never returns."""
    def __init__(self, prompt):
        self.turns = 0
    def step(self, action):
        if action == "hang":
            time.sleep(3600)
        self.turns += 1
        return f"turn {self.turns}", 0.0, False
'''


def test_a_killed_worker_loses_every_episode_it_held_and_blames_the_one_that_hung(tmp_path, monkeypatch):
    """One worker holds episodes 0 and 1; in turn 1 episode 0 steps, then episode 1 hangs and the
    worker's process is killed, taking episode 0's environment with it. Turn 2 must say episode 0
    was lost with the process that ended on episode 1's prompt (it raised KeyError in the fresh
    process before), and ending both must not start a process only to drop nothing."""
    (tmp_path / "hangs_on_env.py").write_text(HANGS_ON)
    monkeypatch.chdir(tmp_path)
    pool = EnvironmentPool("hangs_on_env:HangsOn", 1, timeout_s=1.0)
    try:
        episodes = [Episode(i, f"prompt {i}", {}, None) for i in range(2)]
        pool.start(episodes)
        first = pool.step(episodes, ["go", "hang"], turn=1)
        second = pool.step(episodes[:1], ["go"], turn=2)
        start = time.monotonic()
        pool.end(episodes)
        ending = time.monotonic() - start
        assert pool.workers[0].proc is None  # no process was started for the end
    finally:
        pool.close()
    assert first[0].observation == "turn 1" and "ran past" in str(first[1])
    assert isinstance(second[0], EnvironmentFailedError)
    assert "on prompt 'prompt 0': lost with its process, which ended on prompt 'prompt 1'" in str(second[0])
    assert ending < 0.5


SPAWNS = '''
import subprocess, time

class RunsAShell:
    """A tool that starts a process of its own (as a code interpreter or a shell does), then hangs."""
    def __init__(self, prompt):
        pass
    def step(self, action):
        tool = subprocess.Popen(["sleep", "3600"])
        with open("tool.pid", "w") as f:
            f.write(str(tool.pid))
        time.sleep(3600)
'''


def test_a_timed_out_tool_leaves_no_process_it_started(tmp_path, monkeypatch):

    (tmp_path / "spawns_env.py").write_text(SPAWNS)
    monkeypatch.chdir(tmp_path)
    pool = EnvironmentPool("spawns_env:RunsAShell", 1, timeout_s=1.0)
    try:
        episode = Episode(0, "prompt 0", {}, None)
        pool.start([episode])
        (result,) = pool.step([episode], ["run"], turn=1)
    finally:
        pool.close()
    assert "ran past" in str(result)
    pid = int((tmp_path / "tool.pid").read_text())
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the tool's own process outlived the killed environment"


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its (gone) parent's reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_overlong_ramp_counts_the_policys_tokens_not_the_observations():
    """DAPO's overlong shaping over an episode of 3 action tokens and 2 observation tokens, with
    L_max = 5 and a ramp over the last 2 tokens: the policy wrote 3 tokens, under the ramp (no
    penalty); counting the tool's 2 tokens too would have put it at the limit (-1)."""
    rule = TruncationRule("terminal", max_new_tokens=5, overlong_buffer=2, overlong_penalty=1.0)
    cfg = PPOConfig(advantage="dr_grpo", whiten_advantages=False)
    rollout = _two_turn_rollout("stop")
    rollout.group_id = [0]
    exp = _experience(RolloutTensors.of(rollout, 0), None, 0.0, ExperienceSettings(cfg, rule))
    last_action = 4
    assert float(exp.rewards[0, last_action]) == pytest.approx(2.0 + 1.0)  # score + the last turn's reward, no ramp
