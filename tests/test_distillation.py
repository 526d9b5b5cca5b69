"""On-policy distillation (docs/distillation.md): a teacher scores the student's own tokens, the
learner lowers the reverse KL to it. The per-token term against a hand computation from two tiny
models, the two modes' gradients against their derivation, the tokenizer check before anything
starts, the config's refusals, and a student that moves toward its teacher. Two learner ranks against
the in-process trainer, and a SIGKILLed teacher, are in ``test_distributed.py`` (its local Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.settings import sampling_settings, teacher_args
from rayppo.actors.teacher import TeacherEngine
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.prompts import PromptBatch
from rayppo.errors import ModelFolderError
from rayppo.learner import ppo
from rayppo.learner.experience import make_experience
from rayppo.learner.learn_settings import LearnSettings, StepInputs
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.loading import load_causal_lm
from rayppo.models.teacher import tokenizer_difference
from rayppo.plan.inputs import check_inputs
from rayppo.trainers.evaluation import HeldOutResult, teacher_figures
from rayppo.trainers.iteration import distill_stats

pytestmark = pytest.mark.slow

PROMPTS = ["say 3 :", "say 7 :", "say 1 :", "say 9 :"]


def _hand_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each response token, from one plain transformers forward of prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + t, token].item() for t, token in enumerate(response)]


def _student_rollout(embedded_dir, tokenizer, cfg):
    generator = GeneratorEngine(str(embedded_dir), sampling_settings(cfg), backend="hf")
    prompts = PromptBatch(PROMPTS, [tokenizer(p)["input_ids"] for p in PROMPTS]).groups_of(2)
    return generator.generate(prompts, seed=0)


def test_the_per_token_reward_is_the_teacher_log_ratio_of_two_tiny_models(embedded_dir, digits_teacher, tokenizer):
    """d_t = -coef (log pi_old(y_t) - log pi_T(y_t)): the teacher actor's log-probs and the advantage the
    learner builds equal a hand computation from two plain forwards (the student, the trained teacher).
    GRPO on equal scores gives the task 0, so the advantage is the distillation term alone: itself at
    distill.gamma = 0, its reward-to-go at gamma = 1, less the batch's mean token with distill.center."""
    overrides = ["trainer=reference", "ppo.advantage=grpo", "rollout.samples_per_prompt=2",
                 f"distill.teacher={digits_teacher}", "distill.coef=0.5"]
    cfg = load_config(None, overrides)
    rollout = _student_rollout(embedded_dir, tokenizer, cfg)
    teacher = TeacherEngine(**teacher_args(cfg, 0.0))
    taught = rollout.scored([0.0] * len(rollout), teacher=teacher.teacher_logprobs(rollout))
    student_model = load_causal_lm(str(embedded_dir), "float32").eval()
    teacher_model = load_causal_lm(str(digits_teacher / "policy"), "float32").eval()
    T = cfg.rollout.temperature
    hand_student = [_hand_logprobs(student_model, p, r, T) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
    hand_teacher = [_hand_logprobs(teacher_model, p, r, T) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
    gaps = [abs(s - t) for row_s, row_t in zip(hand_student, hand_teacher) for s, t in zip(row_s, row_t)]
    assert max(gaps) > 0.1  # two different models: the term is not 0 by accident
    for i in range(len(rollout)):
        # fp32 forwards of the same ids, packed or padded: agreement to rounding (~1e-6 nats).
        assert taught.teacher_logprobs[i] == pytest.approx(hand_teacher[i], abs=1e-5)
        assert taught.logprobs[i] == pytest.approx(hand_student[i], abs=1e-5)
    d = [[-0.5 * (s - t) for s, t in zip(row_s, row_t)] for row_s, row_t in zip(hand_student, hand_teacher)]
    mean_d = sum(x for row in d for x in row) / sum(len(row) for row in d)
    for gamma, center in ((0.0, False), (1.0, False), (0.0, True)):
        settings = LearnSettings.of(load_config(None, overrides + [f"distill.gamma={gamma}", f"distill.center={center}"]))
        tensors = RolloutTensors.of(taught, tokenizer.pad_token_id)
        plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.0), tensors)
        assert plan.distill_reward_coef == 0.5 and plan.distill_loss_coef == 0.0
        advantages = make_experience(tensors, None, plan).experience.advantages
        for i, row in enumerate(d):
            expected = [sum(row[t:]) for t in range(len(row))] if gamma else row
            expected = [x - mean_d for x in expected] if center else expected  # the batch's mean token
            assert advantages[i, : len(row)].tolist() == pytest.approx(expected, abs=1e-5), (gamma, center, i)
            assert not advantages[i, len(row):].any()  # padding
    # distill.task_reward = w weighs the task's advantage: w A_t + D_t (rows that earned a score now).
    scored = taught.scored([float(i % 2) for i in range(len(taught))])

    def advantages_at(weight: float) -> torch.Tensor:
        settings = LearnSettings.of(load_config(None, overrides + [f"distill.task_reward={weight}"]))
        tensors = RolloutTensors.of(scored, tokenizer.pad_token_id)
        plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.0), tensors)
        return make_experience(tensors, None, plan).experience.advantages

    whole, none, half = advantages_at(1.0), advantages_at(0.0), advantages_at(0.5)
    assert (whole - none).abs().max() > 0.5  # GRPO's advantages of the 0/1 scores
    assert half.flatten().tolist() == pytest.approx((none + 0.5 * (whole - none)).flatten().tolist(), abs=1e-6)


def test_the_teacher_sends_its_top_k_and_the_loss_term_reads_the_students_log_probs_at_them(
        embedded_dir, digits_teacher, tokenizer):
    """``distill.topk`` = 4: the teacher actor's ids and log-probs per response position are its full
    log-softmax's 4 largest (a hand forward, fp32 to 1e-5 nats), most likely first; they cross the
    Arrow record and become the experience's [B, T, 4] fields; the loss term is
    ``ppo.topk_reverse_kl`` of the student's log-probs at those ids (a hand forward of the student),
    aggregated as the policy loss (token mean)."""
    from rayppo.data.rollout import Rollout
    from rayppo.learner.minibatches import MicroBatch
    from rayppo.learner.objectives import policy_objective

    overrides = ["trainer=reference", "ppo.advantage=grpo", "rollout.samples_per_prompt=2", "distill.mode=loss",
                 f"distill.teacher={digits_teacher}", "distill.coef=0.5", "distill.topk=4"]
    cfg = load_config(None, overrides)
    rollout = _student_rollout(embedded_dir, tokenizer, cfg)
    scores = TeacherEngine(**teacher_args(cfg, 0.0)).teacher_logprobs(rollout)
    taught = Rollout.from_arrow(rollout.scored([0.0] * len(rollout), teacher=scores).to_arrow())
    T = cfg.rollout.temperature

    def hand(model_dir, prompt, response) -> torch.Tensor:  # [T_b, V] log softmax at the response positions
        model = load_causal_lm(str(model_dir), "float32").eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits / T, -1)

    hands = []
    for i, (prompt, response) in enumerate(zip(rollout.prompt_ids, rollout.response_ids)):
        teacher_full = hand(digits_teacher / "policy", prompt, response)
        top, _ = teacher_full.topk(4, -1)
        ids = torch.tensor(taught.teacher_top_ids[i])
        assert ids.shape == (len(response), 4)
        assert torch.tensor(taught.teacher_top_logprobs[i]) == pytest.approx(top, abs=1e-5)
        assert teacher_full.gather(-1, ids) == pytest.approx(top, abs=1e-5)  # the ids are the ones they name
        hands.append((hand(embedded_dir, prompt, response).gather(-1, ids), top))
    settings = LearnSettings.of(cfg)
    tensors = RolloutTensors.of(taught, tokenizer.pad_token_id)
    plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.0), tensors)
    exp = make_experience(tensors, None, plan).experience
    assert exp.teacher_top_ids.shape == (len(rollout), exp.batch.mask.shape[1], 4)
    student = load_causal_lm(str(embedded_dir), "float32")
    n = int(exp.batch.mask.sum())
    everyone = torch.arange(len(rollout))
    _, stats, _ = policy_objective(student, exp, MicroBatch(everyone, token_share=1.0, row_share=1.0), plan)
    expected = sum(ppo.topk_reverse_kl(s, t).sum().item() for s, t in hands) / n
    assert stats["policy/distill_loss"].item() == pytest.approx(expected, abs=1e-5)
    assert expected > 0.05  # two different models: the term is there to be compared


def test_loss_and_reward_modes_move_the_sampled_token_the_same_way():
    """A hand-derived case: the student is uniform over 3 tokens (theta = 0), the teacher puts 0.7 on
    token 0. Sampled token 0: reward mode's advantage is -(log 1/3 - log 0.7) = log 2.1 > 0, and the
    clipped loss at ratio 1 has gradient -A grad log pi(0) = -log 2.1 (e_0 - 1/3); the k2 loss term
    0.5 (log pi(0) - log 0.7)^2 has gradient (log 1/3 - log 0.7) grad log pi(0): the same vector
    (on the student's samples k2's gradient is the reverse KL's), so one step raises theta_0 in both.
    k3's gradient (1 - pi_T/pi) grad log pi points the same way; k1's, grad log pi, the other way."""
    teacher = torch.tensor([0.7, 0.2, 0.1]).log()
    mask = torch.ones(1, 1)
    sampled = 0

    def gradient(loss_of) -> torch.Tensor:
        theta = torch.zeros(3, requires_grad=True)
        logprob = torch.log_softmax(theta, -1)[sampled].reshape(1, 1)
        loss_of(logprob, teacher[sampled].reshape(1, 1)).backward()
        return theta.grad

    def reward_mode(logprob, teacher_lp):
        advantage = ppo.distill_advantages(ppo.distill_rewards(logprob.detach(), teacher_lp, mask, 1.0), mask)
        return ppo.policy_loss(logprob, logprob.detach(), advantage, mask)[0]

    def loss_mode(estimator):
        return lambda logprob, teacher_lp: ppo.aggregate(ppo.kl_penalty(logprob, teacher_lp, estimator), mask)

    by_hand = -math.log(2.1) * (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3)
    assert gradient(reward_mode) == pytest.approx(by_hand.tolist(), abs=1e-6)
    assert gradient(loss_mode("k2")) == pytest.approx(by_hand.tolist(), abs=1e-6)
    k3 = gradient(loss_mode("k3"))  # (1 - 0.7 / (1/3)) (e_0 - 1/3): -1.1 times grad log pi(0)
    assert k3 == pytest.approx((-1.1 * (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3)).tolist(), abs=1e-6)
    assert gradient(loss_mode("k1"))[0] > 0  # descent would lower theta_0: the teacher is ignored
    for g in (gradient(reward_mode), gradient(loss_mode("k2")), k3):
        assert g[0] < 0 < g[1]  # gradient descent raises theta_0 (the teacher's token), lowers the others


def test_topk_reverse_kl_by_hand_exact_at_full_vocabulary_and_a_lower_bound_below_it():
    """``ppo.topk_reverse_kl``. By hand: student q = (0.5, 0.3, 0.2), teacher p = (0.6, 0.1, 0.3), the
    teacher's top 1 is token 0: KL_1 = 0.5 log(0.5/0.6) + 0.5 log(0.5/0.4). With k = V it is the exact
    reverse KL, value and gradient (fp64; the tails are below the floor k ulp(1) and add 0), and for
    every smaller k it lies between 0 and the full KL (merging outcomes cannot raise a KL)."""
    q, p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    kl_1 = ppo.topk_reverse_kl(q.log()[:1], p.log()[:1])
    assert kl_1.item() == pytest.approx(0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4), abs=1e-12)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(4, 50, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(2 * torch.randn(4, 50, generator=g, dtype=torch.float64), -1)
    student = torch.log_softmax(theta, -1)
    full = (student.exp() * (student - teacher)).sum(-1)
    order = teacher.argsort(-1, descending=True)  # the teacher's top ids first, as the teacher actor sends them
    exact = ppo.topk_reverse_kl(student.gather(-1, order), teacher.gather(-1, order))
    torch.testing.assert_close(exact, full, rtol=0, atol=1e-12)
    (grad_full,) = torch.autograd.grad(full.sum(), theta, retain_graph=True)
    (grad_topk,) = torch.autograd.grad(exact.sum(), theta, retain_graph=True)
    torch.testing.assert_close(grad_topk, grad_full, rtol=0, atol=1e-12)
    for k in (1, 5, 20, 49):
        top = order[:, :k]
        kl_k = ppo.topk_reverse_kl(student.gather(-1, top), teacher.gather(-1, top))
        assert (kl_k >= -1e-12).all() and (kl_k <= full + 1e-12).all(), k
    five = ppo.topk_reverse_kl(student.gather(-1, order[:, :5]), teacher.gather(-1, order[:, :5]))
    assert (five < full - 1e-3).any()  # a coarsening loses something here: the bound is not trivially tight


def test_a_teacher_with_another_tokenizer_is_refused_before_any_actor_starts(copy_model, embedded_dir, tmp_path):
    """The teacher reads the student's token ids: another vocabulary is refused by name in the trainer's
    constructor, before Ray starts; the same tokenizer passes."""
    import ray
    from transformers import AutoTokenizer

    from rayppo.trainers.distributed import DistributedTrainer

    other = copy_model("other_tokenizer")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<teacher-only>"])
    tok.save_pretrained(other)
    assert tokenizer_difference(copy_model("same"), embedded_dir) is None
    assert "vocabulary" in tokenizer_difference(other, embedded_dir)
    ray.shutdown()  # whatever an earlier module left: the constructor must not start one
    message = r"^distill.teacher: the teacher's tokenizer differs from the policy's: vocabulary of \d+ tokens against \d+"
    with pytest.raises(ModelFolderError, match=message):  # rayppo train's input checks, before torch is imported
        check_inputs(load_config(None, [f"distill.teacher={other}"]))
    with pytest.raises(ModelFolderError, match=message):  # and the trainer's own, for a caller that skips them
        DistributedTrainer(load_config(None, [f"distill.teacher={other}", f"output.dir={tmp_path / 'run'}"]))
    assert not ray.is_initialized()  # refused before anything started
    assert not (tmp_path / "run" / "logs").exists()


def test_a_topk_the_teachers_vocabulary_cannot_fill_is_refused_before_any_actor_starts(embedded_dir, tmp_path):
    """k of the teacher's tokens per position and the rest as one outcome need k < V: a larger k is
    refused by field in the trainer's constructor, with the vocabulary's size, before Ray starts."""
    import ray
    from transformers import AutoTokenizer

    from rayppo.trainers.distributed import DistributedTrainer

    vocabulary = len(AutoTokenizer.from_pretrained(embedded_dir))
    ray.shutdown()
    overrides = ["distill.teacher=embedded", "distill.mode=loss", f"output.dir={tmp_path / 'run'}"]
    with pytest.raises(ModelFolderError, match=rf"^distill.topk: {vocabulary} is not below the teacher's "
                                               rf"vocabulary of {vocabulary} tokens .*take at most {vocabulary - 1}"):
        DistributedTrainer(load_config(None, [*overrides, f"distill.topk={vocabulary}"]))
    assert not ray.is_initialized() and not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize("overrides, message", [
    (["distill.mode=loss", "distill.estimator=k1"], r"^distill.estimator: k1 as a loss term has the gradient"),
    (["distill.gamma=1.5"], r"^distill.gamma: must be in \[0, 1\]"),
    (["distill.mode=loss", "distill.gamma=0.5"], r"^distill.gamma: discounts the distillation rewards"),
    (["distill.coef=0"], r"^distill.coef: must be > 0"),
    (["distill.task_reward=-1"], r"^distill.task_reward: must be >= 0"),
    (["distill.num=0"], r"^distill.num: must be >= 1"),
    (["cluster.colocate_all=true"], r"^distill.teacher: cannot run with cluster.colocate_all"),
    (["distill.topk=8"], r"^distill.topk: is the loss term's full-distribution KL: it needs distill.mode=loss"),
    (["distill.mode=loss", "distill.topk=-1"], r"^distill.topk: must be >= 0"),
    (["distill.mode=loss", "distill.topk=8", "distill.estimator=k3"], r"^distill.estimator: estimates the KL"),
])
def test_distill_settings_are_checked_at_load_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["distill.teacher=embedded", *overrides])


def test_the_teacher_figures_and_the_reverse_kl_figures():
    """``distill/reached`` divides the student's figure by the teacher's (greedy pass rate first);
    the reverse KL figures read the action tokens only."""
    student = HeldOutResult({"eval/greedy/pass_rate": 0.45, "eval/reward/mean": 0.5, "time/eval": 3.0}, 0.5, None)
    teacher = HeldOutResult({"eval/greedy/pass_rate": 0.6, "eval/reward/mean": 0.7, "time/eval": 9.0}, 0.7, None)
    figures = teacher_figures(student, teacher)
    assert figures == {"eval/teacher/greedy/pass_rate": 0.6, "eval/teacher/reward/mean": 0.7,
                       "distill/reached": pytest.approx(0.75)}
    from rayppo.data.rollout import Rollout

    rollout = Rollout([[1], [1]], [[5, 6, 7], [8, 9]], [[-1.0, -2.0, -0.5], [-0.1, -3.0]], ["stop"] * 2, ["a", "b"],
                      ["", ""], teacher_logprobs=[[-0.5, -0.5, -0.5], [-0.1, -1.0]],
                      action_mask=[[1, 0, 1], [1, 1]])
    stats = distill_stats(rollout)  # k1 per action token: -0.5, 0.0 | 0.0, -2.0 (token 2 of row 0 is an observation)
    assert stats["distill/reverse_kl_mean"] == pytest.approx(-2.5 / 4)
    assert stats["distill/reverse_kl_per_response"] == pytest.approx((-0.5 + -2.0) / 2)
    assert stats["distill/reverse_kl_p90"] == pytest.approx(0.0)


def test_pure_distillation_moves_the_student_toward_its_teacher(digits_teacher, tmp_path):
    """distill.task_reward=0: the digit reward only measures, the teacher's term alone trains. The
    teacher (20 iterations of the default run) scores well above the student; after 10 iterations
    the per-token reverse KL has fallen and the student has reached more of the teacher's held-out
    score, side by side at each evaluation."""
    from rayppo.run.metrics import read_metrics
    from rayppo.train import train

    out = tmp_path / "run"
    train(load_config(None, ["trainer=reference", f"distill.teacher={digits_teacher}", "distill.task_reward=0",
                             "ppo.advantage=grpo", "rollout.samples_per_prompt=4", "rollout.batch_size=16",
                             "eval.every=5", "eval.at_start=true", "stop.iterations=10", f"output.dir={out}"]),
          progress=False)
    records = read_metrics(out / "metrics.jsonl")
    first, last = records[0], records[-1]
    reached = [first["initial/distill/reached"]] + [r["distill/reached"] for r in records if "distill/reached" in r]
    kl = [round(r["distill/reverse_kl_mean"], 3) for r in records]
    print(f"reached {[round(x, 3) for x in reached]}, reverse KL {kl}, teacher {last['eval/teacher/reward/mean']:.3f}")
    teacher = {r["eval/teacher/reward/mean"] for r in records if "eval/teacher/reward/mean" in r}
    assert teacher == {first["initial/eval/teacher/reward/mean"]}  # measured once: the same at every evaluation
    assert last["distill/reverse_kl_mean"] < 0.5 * first["distill/reverse_kl_mean"]
    assert reached[-1] > reached[0] + 0.2


def test_the_plan_counts_the_teacher_and_its_memory(digits_teacher):
    """``rayppo plan`` has a teacher row (a run folder names its policy/): the reference's parts for
    the teacher's model, plus the copy its held-out answers are sampled with; no row without a teacher."""
    from rayppo.plan.fit import THIS_MACHINE, make_plan, plan_json
    from rayppo.plan.footprint import estimate_roles

    cfg = load_config(None, [f"distill.teacher={digits_teacher}"])
    est = estimate_roles(cfg)
    teacher, reference = est["teacher"].parts, est["reference"].parts  # the same architecture here
    assert teacher == {**reference, "held-out sampling copy (once)": reference["weights"]}
    assert "teacher" not in estimate_roles(load_config(None, []))
    roles = plan_json(cfg, make_plan(cfg, {"CPU": 4.0, "GPU": 0.0}, THIS_MACHINE))["roles"]
    assert roles["teacher"]["actors"] == 1 and roles["teacher"]["cpus"] == 0.25
