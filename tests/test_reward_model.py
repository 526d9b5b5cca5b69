"""A learned reward model r_φ (``rayppo reward-model``): the Bradley–Terry loss against a hand
computation, pair files refused row by row, a model trained on the embedded model that ranks
held-out pairs and serves as ``reward.model`` with the scores it was evaluated with, a critic that
starts from its head, its training on two Ray ranks equal to one rank in process and resumed on
another split; PPO with the four models (and a gold scorer beside r_φ) equal on two ranks and in
process; the proxy-versus-gold stop rule."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp_rounding import U32, U64, forward_rounding, gamma
from transformers import AutoModelForSequenceClassification

from rayppo.actors.reward import ModelScorer, RewardEngine
from rayppo.cli import main
from rayppo.config.derived import reference_actors
from rayppo.config.load import load_config
from rayppo.data.pairs import held_out_split, read_pairs
from rayppo.data.rollout import Rollout
from rayppo.learner.bradley_terry import bradley_terry_loss, pair_means, pair_sums
from rayppo.models.loading import Critic, load_tokenizer
from rayppo.models.reward_stats import STATS_FILE, RewardStats
from rayppo.run.gold import GoldWatch
from rayppo.run.metrics import read_metrics
from rayppo.tasks.digits import DIGITS, VERBS, make_prompt
from rayppo.tasks.digits import reward as digits_reward
from rayppo.trainers.distributed import DistributedTrainer
from rayppo.trainers.inprocess import InProcessTrainer
from rayppo.trainers.reward_model_trainer import RewardModelResult, prepared_pairs, train_reward_model
from rayppo.trainers.verifier_pairs import group_pairs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PAIRS = 160
HELD_OUT = 0.25
"""40 held-out pairs: a ranking at chance gets 32 or more right with probability 1.1e-4."""
STEPS = 2 * ((PAIRS - round(HELD_OUT * PAIRS)) // 16)
"""Two epochs of whole steps of 16 pairs: 14."""
TRAIN = ["preference.batch_pairs=16", "preference.epochs=2", "preference.lr=1e-4", f"preference.held_out={HELD_OUT}",
         "preference.micro_pairs=4"]


def write_digit_pairs(path: Path, n: int = PAIRS, seed: int = 0) -> Path:
    """Pairs of the digits task: the chosen response repeats the prompt's digit, the rejected one
    writes other digits (what its verifier prefers)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            verb, digit = rng.choice(VERBS), rng.choice(DIGITS)
            chosen = " ".join([digit] * rng.randint(4, 6))
            rejected = " ".join(rng.choice([d for d in DIGITS if d != digit]) for _ in range(rng.randint(4, 6)))
            f.write(json.dumps({"prompt": make_prompt(verb, digit), "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def test_verifier_pairs_put_the_best_against_the_worst_where_the_verifier_prefers_one():
    texts = ["a", "b", "c", "d", "a ", "e"]
    scores = [1.0, 0.0, 1.0, 0.5, 1.0, 0.0]
    # "a" twice (by its stripped text): once; then best-with-worst, second-with-second-last.
    assert group_pairs(texts, scores, limit=2) == [(0, 5), (2, 1)]
    assert group_pairs(texts, scores, limit=1) == [(0, 5)]
    assert group_pairs(["x", "y", "z"], [0.5, 0.5, 0.5], limit=2) == []  # all alike: no pair
    assert group_pairs(["x", "y", "z", "w"], [1.0, 0.5, 0.5, 0.0], limit=3) == [(0, 3)]  # 0.5 vs 0.5 is no preference
    assert group_pairs(["x", " ", "y", ""], [1.0, 0.0, 0.5, 0.0], limit=2) == [(0, 2)]  # empty: never paired


def test_rayppo_pairs_labels_the_policys_samples_with_the_verifier(tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    rc = main(["pairs", f"preference.pairs={out}", "preference.samples_per_prompt=4", "preference.max_pairs=40",
               "rollout.batch_size=16", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and "pairs: 40 pairs from" in capsys.readouterr().out
    for row in rows:  # the scores are the verifier's (the default digits reward), chosen strictly better
        assert digits_reward(row["prompt"], row["chosen"]) == row["chosen_score"] > row["rejected_score"]
        assert digits_reward(row["prompt"], row["rejected"]) == row["rejected_score"]
    assert len(read_pairs(out)) == 40  # what rayppo reward-model reads


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_dir):
    """r_φ trained on the embedded model by ``rayppo reward-model trainer=reference`` (14 steps, one
    in-process rank, ~5 s), in a process of its own: this one keeps no learner group that later
    tests' in-process engines would meet. Returns (run folder, pairs file, result)."""
    root = tmp_path_factory.mktemp("rm")
    pairs = write_digit_pairs(root / "pairs.jsonl")
    run = root / "run"
    proc = subprocess.run([sys.executable, "-m", "rayppo.cli", "reward-model", f"preference.pairs={pairs}",
                           f"output.dir={run}", "trainer=reference", "--no-progress", *TRAIN],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = read_metrics(run / "metrics.jsonl")[-1]  # the last step ends the last epoch: its evaluation is the final one
    held = {key: last[f"rm/eval/{key}"] for key in ("loss", "accuracy", "margin")}
    return run, pairs, RewardModelResult(last["iteration"] + 1, held, run / "reward_model", 0.0)


def test_bradley_terry_loss_matches_a_hand_computation():
    chosen = torch.tensor([1.0, -0.5, 2.0, 0.25])
    rejected = torch.tensor([0.0, 0.5, 2.5, 0.25])
    margins = [1.0, -1.0, -0.5, 0.0]
    # -log sigma(m) = log(1 + e^-m), in float64; float32 rounds each term by ~6e-8 relative.
    expected = sum(math.log1p(math.exp(-m)) for m in margins) / 4
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, abs=1e-6)
    means = pair_means(pair_sums(chosen, rejected))
    assert means == pytest.approx({"loss": expected, "accuracy": 0.25, "margin": -0.125}, abs=1e-6)  # a tie is not right


def _trl_venv_module():
    """``benchmarks/bench_trl_venv.py`` (benchmarks/ is not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_trl_venv
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_trl_venv


def _trl_python() -> Path | None:
    """TRL 1.16's environment (``benchmarks/bench_trl_venv.py``), when it has been made."""
    module = _trl_venv_module()
    venv = module.choose_trl_venv(module.TRL_GRPO)
    return venv.path / "bin" / "python" if venv.state == "ready" else None


@pytest.mark.skipif(_trl_python() is None, reason="TRL runs in its own environment (.venv-trl-1.16, pinned torch "
                    "and trl), made once by 'rayppo bench --compare trl' on a GRPO workload or by "
                    "benchmarks/reward_model_speed.py; this suite does not install it")
def test_the_bradley_terry_loss_equals_trl_reward_trainers_on_the_same_pairs(trained, tmp_path):
    """TRL's ``RewardTrainer.compute_loss`` on the held-out pairs, tokenised by rayppo, with the
    trained r_φ, equals the held-out loss rayppo's learner computed (fp32 both; TRL pads the 40
    pairs into one batch, rayppo into micro-batches of 4: rounding of order 1e-7 per score)."""
    run, pairs_file, result = trained
    cfg = load_config(None, [f"preference.pairs={pairs_file}", *TRAIN])
    pairs, tokens = prepared_pairs(cfg)
    _, rows = held_out_split(len(pairs), HELD_OUT, seed=0)
    spec = {"model": str(result.folder), "chosen_ids": [tokens.chosen[i] for i in rows],
            "rejected_ids": [tokens.rejected[i] for i in rows], "batch_pairs": len(rows), "lr": 1e-5,
            "max_grad_norm": 1.0, "work_dir": str(tmp_path / "trl")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(_trl_python()), str(BENCHMARKS / "trl_reward.py"), "--spec", str(tmp_path / "spec.json"),
                    "--out", str(tmp_path / "trl.json"), "--loss-only"], check=True,
                   env=_trl_venv_module().trl_environment())  # an in-process rank's rendezvous left out
    trl_loss = json.loads((tmp_path / "trl.json").read_text())["loss"]
    assert trl_loss == pytest.approx(result.held_out["loss"], abs=1e-5)


def test_bradley_terry_loss_is_finite_for_a_pair_ranked_far_the_wrong_way():
    chosen = torch.tensor([-200.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, torch.tensor([0.0]))
    loss.backward()
    assert loss.item() == pytest.approx(200.0) and chosen.grad.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "say 1 :", "chosen": "1 1 1 1", "rejected": "1 1 1 1"}, "row 2: 'chosen' and 'rejected' are the same"),
    ({"prompt": "say 1 :", "chosen": "  ", "rejected": "2"}, "row 2: field 'chosen' must be a non-empty response"),
    ({"prompt": "say 1 :", "chosen": "1"}, "row 2: missing field 'rejected'"),
    ({"prompt": "say 1 :", "chosen": "1", "rejected": 2}, "row 2: field 'rejected' must be a non-empty response (got int)"),
    ({"prompt": "say 1 : " * 40, "chosen": "1", "rejected": "2"}, "row 2: the prompt with its 'chosen' response is"),
])
def test_a_bad_pair_is_refused_with_one_line_naming_its_row(tmp_path, capsys, row, expected):
    good = {"prompt": "say 3 :", "chosen": "3 3 3 3", "rejected": "4 5 6 7"}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    out = tmp_path / "run"
    rc = main(["reward-model", f"preference.pairs={pairs}", f"output.dir={out}", "trainer=reference",
               "preference.max_tokens=64", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and expected in err and str(pairs) in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (out / "reward_model").exists()


def test_a_trained_reward_model_ranks_held_out_pairs_and_serves_them_as_it_was_evaluated(trained):
    run, pairs_file, result = trained
    records = read_metrics(run / "metrics.jsonl")
    assert len(records) == result.steps == STEPS
    assert records[-1]["rm/loss"] < records[0]["rm/loss"]
    held = result.held_out
    assert held["accuracy"] >= 0.8 and held["loss"] < math.log(2) and held["margin"] > 0, held
    # The folder is a transformers sequence classifier, and the reward actor scores the held-out
    # pairs with it as the learner evaluated them (same text rule, same token read).
    assert AutoModelForSequenceClassification.from_pretrained(result.folder).config.num_labels == 1
    pairs = read_pairs(pairs_file)
    _, rows = held_out_split(len(pairs), HELD_OUT, seed=0)
    scorer = RewardEngine(ModelScorer(str(result.folder), batch_size=7, normalize=False))
    rollouts = {c: _rollout([pairs.prompts[i] for i in rows], [getattr(pairs, c)[i] for i in rows])
                for c in ("chosen", "rejected")}
    raw = {c: torch.tensor(scorer.scores(r)) for c, r in rollouts.items()}
    served = pair_means(pair_sums(raw["chosen"], raw["rejected"]))
    # Both sides run fp32 forwards of the same tokens, padded into other batches: each score within
    # E of its exact value (tests/fp_rounding.py: the first-order bound from u = 2^-24, the matmuls'
    # lengths and the magnitudes of this model's values and gradients on this row), so a pair's
    # margin m within D = 2 (E_chosen + E_rejected) of the learner's. pair_sums then rounds in fp32
    # on each side: m (1 rounding), -log sigma(m) (<= 8), a sum of n (gamma_n): 2 gamma_{n+9} of the
    # magnitudes. -log sigma is 1-Lipschitz; a pair's correctness can differ only where |m| <= D.
    _, tokens = prepared_pairs(load_config(None, [f"preference.pairs={pairs_file}", *TRAIN]))
    exact = AutoModelForSequenceClassification.from_pretrained(result.folder, dtype=torch.float64,
                                                               attn_implementation="eager").eval()
    e = {c: torch.tensor([forward_rounding(exact, getattr(tokens, c)[i]) for i in rows], dtype=torch.float64)
         for c in ("chosen", "rejected")}
    n, margin = len(rows), (raw["chosen"] - raw["rejected"]).double()
    d = 2 * (e["chosen"] + e["rejected"])
    arithmetic = 2 * gamma(n + 9) * float((-F.logsigmoid(margin)).sum() + margin.abs().sum())
    assert served["loss"] == pytest.approx(held["loss"], abs=(float(d.sum()) + arithmetic) / n, rel=0)
    assert served["margin"] == pytest.approx(held["margin"], abs=(float(d.sum()) + arithmetic) / n, rel=0)
    assert abs(served["accuracy"] - held["accuracy"]) * n <= int((margin.abs() <= d + 2 * U32 * margin.abs()).sum())
    # Far below what a wrong text moves the figures by: without the response's last word (another
    # token read) the loss moves by 0.014, without the space before the response by 0.034.
    assert (float(d.sum()) + arithmetic) / n < 0.002
    # reward.normalize (the default): centred and scaled by the held-out responses' own figures, the
    # learner's fp32 scores each within 2E of the served ones; float64 sums of 2n values after.
    stats = RewardStats.read(result.folder)
    assert stats is not None and stats.responses == 2 * n
    both, e_both = torch.cat([raw["chosen"], raw["rejected"]]).double(), torch.cat([e["chosen"], e["rejected"]])
    float64 = 4 * 2 * n * U64 * float(both.abs().max())  # a mean, a variance, a root: 4 x 2n float64 roundings
    assert stats.mean == pytest.approx(both.mean().item(), abs=float(2 * e_both.mean()) + float64, rel=0)
    # The population std is 1-Lipschitz in the largest change of one score (std(x + d) - std(x) <= max |d|).
    assert stats.std == pytest.approx(both.std(unbiased=False).item(), abs=float(2 * e_both.max()) + float64, rel=0)
    normalized = RewardEngine(ModelScorer(str(result.folder), batch_size=7)).scores(rollouts["chosen"])
    expected = (raw["chosen"].double() - stats.mean) / stats.std  # float64: 2 roundings, as the engine's own
    assert torch.all((torch.tensor(normalized, dtype=torch.float64) - expected).abs()
                     <= 2 * e["chosen"] / stats.std + 4 * U64 * expected.abs())


def test_a_damaged_reward_statistics_file_is_refused_before_the_run_starts(trained, tmp_path, capsys):
    _, _, result = trained
    folder = tmp_path / "rm"
    shutil.copytree(result.folder, folder)
    (folder / STATS_FILE).write_text('{"mean": 0.1, "std": 0.0, "responses": 80}')
    rc = main(["train", f"reward.model={folder}", "reward.function=null", f"output.dir={tmp_path / 'run'}",
               "trainer=reference", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{folder / STATS_FILE}: mean 0.1 and std 0.0 cannot normalise" in err, err


def test_the_critic_started_from_a_reward_model_values_the_end_of_a_response_at_its_served_reward(trained,
                                                                                                embedded_dir):
    """InstructGPT's initialisation: V's head is r_φ's on r_φ's backbone, so the value at the last
    token of a (prompt, response) is r_φ(x, y) in the unit the reward actor serves it in: raw
    without ``reward.normalize``, (r_φ − mean) / std with it (its ``reward_stats.json``).
    Tolerance: the same fp32 matmul, the normalised one divided by std afterwards."""
    _, _, result = trained
    model = AutoModelForSequenceClassification.from_pretrained(result.folder)
    tokenizer = load_tokenizer(result.folder)
    ids = torch.tensor([tokenizer("say 7 : 7 7 7 7")["input_ids"]])
    positions = torch.arange(ids.shape[1])[None]
    stats = RewardStats.read(result.folder)
    assert stats is not None and abs(stats.mean) > 1e-3 and abs(stats.std - 1) > 1e-3  # the two units differ
    critic = Critic.from_pretrained(result.folder)
    with torch.no_grad():
        reward = model(input_ids=ids).logits[0, 0].item()
        raw = critic(ids, torch.ones_like(ids), positions)[0, -1].item()
        served = Critic.from_pretrained(result.folder, normalize=True)(ids, torch.ones_like(ids), positions)[0, -1]
    assert raw == pytest.approx(reward, abs=1e-5)
    assert served.item() == pytest.approx((reward - stats.mean) / stats.std, abs=1e-5 / stats.std)
    fresh = Critic.from_pretrained(embedded_dir, normalize=True)  # a causal LM: a small random head, not r_φ's
    assert not torch.equal(fresh.value_head.weight, critic.value_head.weight)
    assert fresh.value_head.weight.abs().max() < 1 and fresh.value_head.bias.item() == 0


@pytest.mark.slow
def test_two_ranks_train_the_reward_model_as_one_rank_in_process_and_resume_on_one(trained, tmp_path):
    """The step's pairs dealt to 2 Ray ranks (ZeRO-2, gradients averaged) give the in-process
    rank's losses and held-out figures; a checkpoint after step 10 resumed on 1 rank (resharded)
    ends where the uninterrupted run did. Tolerance: each step's loss is a mean over 16 pairs of
    fp32 scores; the two splits sum the gradient in another order (rounding of order 1e-7
    relative), which Adam's normalised steps of lr=1e-4 carry into losses at the 1e-6 level over 14
    steps, far below a wrong split's effect (a pair counted twice or dropped moves the loss by
    ~1/16 of a pair's)."""
    _, pairs, reference = trained
    out = tmp_path / "run"
    cfg = load_config(None, [f"preference.pairs={pairs}", f"output.dir={out}", "learner.num_ranks=2",
                             "output.checkpoint_every=10", *TRAIN])
    result = train_reward_model(cfg, progress=False)
    expected = read_metrics(reference.folder.parent / "metrics.jsonl")
    got = read_metrics(out / "metrics.jsonl")
    for a, b in zip(got, expected, strict=True):
        assert a["rm/loss"] == pytest.approx(b["rm/loss"], abs=1e-5), a["iteration"]
    assert result.held_out == pytest.approx(reference.held_out, abs=1e-5)
    rc = main(["reward-model", "--resume", str(out), "learner.num_ranks=1", "--no-progress"])
    assert rc == 0
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(STEPS))
    assert resumed[-1]["rm/eval/accuracy"] == pytest.approx(expected[-1]["rm/eval/accuracy"])
    assert resumed[-1]["rm/eval/loss"] == pytest.approx(expected[-1]["rm/eval/loss"], abs=1e-5)


def test_the_gold_stop_rule_fires_when_gold_stalls_while_the_proxy_rises():
    def evals(proxy: list[float], gold: list[float]) -> list[dict[str, float]]:
        return [{"iteration": 5 * i + 4, "eval/reward/mean": p, "eval/gold/mean": g, "reward/mean": 0.0}
                for i, (p, g) in enumerate(zip(proxy, gold))]

    hacked = evals([0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.35, 0.38])
    why = GoldWatch.of_records(2, hacked).verdict()
    assert why is not None and "best (0.400, iteration 9) for 2 evaluations" in why and "0.300 to 0.700" in why
    assert GoldWatch.of_records(3, hacked).verdict() is None  # the window would hold the best itself
    assert GoldWatch.of_records(2, evals([0.1, 0.3, 0.3, 0.2], [0.2, 0.4, 0.35, 0.38])).verdict() is None  # proxy fell too
    assert GoldWatch.of_records(2, evals([0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.35, 0.41])).verdict() is None  # gold improved
    assert GoldWatch.of_records(1, [{"iteration": 0, "reward/mean": 1.0}] * 9).verdict() is None  # no gold scorer: nothing


def test_a_gold_scorer_measures_kl_without_the_penalty():
    """At ``ppo.kl_coef=0`` a gold scorer still gets KL(pi || pi_ref) measured (its figure's x
    axis: how far a run without the penalty went), and the reference changes nothing else: the
    same rewards and updates as the run without it, which loads no reference."""
    base = ["ppo.kl_coef=0", "trainer=reference", "generators.backend=hf", "rollout.batch_size=8",
            "rollout.max_new_tokens=6", "ppo.lr=1e-3"]
    with_gold = load_config(None, base + ["reward.gold_function=rayppo.tasks.digits:reward"])
    plain = load_config(None, base)
    assert reference_actors(with_gold) == with_gold.reference.num and reference_actors(plain) == 0
    measured, unmeasured = InProcessTrainer(with_gold), InProcessTrainer(plain)
    assert unmeasured.reference is None
    for it in range(2):
        got, expected = measured.iteration(), unmeasured.iteration()
        assert "kl/ref_mean" in got and "kl/ref_mean" not in expected and "reward/gold_mean" in got
        for key in ("reward/mean", "policy/loss", "value/loss"):
            assert got[key] == expected[key], (it, key)
    assert got["kl/ref_mean"] > 0  # one update of lr 1e-3 moved the policy off pi_ref


@pytest.mark.slow
def test_ppo_with_four_real_models_trains_as_the_in_process_trainer_on_two_ranks(trained):
    """Policy and reference (the embedded model), the learned r_φ served by the reward actor, the
    critic started from r_φ, and the verifier as the gold scorer: three iterations on 2 ZeRO-2
    ranks in micro-batches give the in-process trainer's losses, KL, proxy and gold rewards
    (the bounds of test_distributed.py's equivalence test: rounding of the split and the
    micro-batching, far below a sharding error's effect)."""
    _, _, result = trained
    models = [f"reward.model={result.folder}", "reward.function=null", f"model.critic={result.folder}",
              "reward.gold_function=rayppo.tasks.digits:reward", "generators.backend=hf", "rollout.batch_size=16",
              "ppo.epochs=2", "ppo.minibatches=2", "rollout.max_new_tokens=6", "ppo.kl_coef=0.05"]
    reference = InProcessTrainer(load_config(None, models + ["trainer=reference", "learner.micro_batch_tokens=0"]))
    expected = [reference.iteration() for _ in range(3)]
    assert expected[0]["value/loss"] > 0 and abs(expected[2]["kl/ref_mean"]) > 1e-4
    trainer = DistributedTrainer(load_config(None, models + ["learner.num_ranks=2", "learner.zero_stage=2",
                                                             "learner.micro_batch_tokens=24"]))
    try:
        got = [trainer.iteration() for _ in range(3)]
    finally:
        trainer.close()
    for it in range(3):
        for key in ("reward/mean", "reward/gold_mean", "policy/loss", "value/loss", "kl/ref_mean", "policy/clipfrac"):
            assert got[it][key] == pytest.approx(expected[it][key], abs=1e-5, rel=1e-4), (it, key)


def _rollout(prompts: list, responses: list[str]) -> Rollout:
    """A rollout of (prompt, response) texts for the reward actor (token fields unused by a reward model)."""
    n = len(prompts)
    return Rollout(prompt_text=list(prompts), response_text=responses, prompt_ids=[[0]] * n, response_ids=[[0]] * n,
                   logprobs=[[0.0]] * n, finish_reason=["stop"] * n)
