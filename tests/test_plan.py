"""``rayppo plan``: parameter counts against real models, the ZeRO arithmetic, the fit check, and
a plan that answers without importing torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayppo.cli import main
from rayppo.cluster.placement import MAX_OVERSUBSCRIPTION, PlacementError, check_capacity
from rayppo.config.load import load_config
from rayppo.models.shape import layer_params, lora_params, param_count, read_shape
from rayppo.plan.activations import Pass, activation_bytes
from rayppo.plan.fit import accelerator_gib, gpu_loads, local_resources, preflight, requested_resources
from rayppo.plan.footprint import GiB, estimate_roles, model_dir, pass_tokens, zero_bytes

BENCH_MODELS = sorted((Path.home() / ".cache" / "rayppo" / "bench").glob("*/policy"))
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False}
COLOCATED_8_GPUS = ["model.dtype=bfloat16", "cluster.colocate_all=true", "learner.num_ranks=8", "learner.gpus_per_rank=1",
                    "generators.num=8", "reference.num=8", "reward.num=8", "learner.zero_stage=3",
                    "learner.gradient_checkpointing=true", "rollout.batch_size=256", "ppo.minibatches=8",
                    "rollout.max_new_tokens=512", "generators.max_model_len=1024"]
RESOURCES_8_GPUS = '{"GPU": 8, "CPU": 64, "memory": 1e12}'


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_matches_real_models(embedded_dir, reward_model_dir):
    from transformers import AutoModelForCausalLM

    from rayppo.models.loading import Critic, load_reward_model

    for path in [embedded_dir, *BENCH_MODELS[:1]]:
        shape = read_shape(path)
        assert param_count(shape) == numel(AutoModelForCausalLM.from_pretrained(path)), path
        assert param_count(shape, "value") == numel(Critic.from_pretrained(path)), path
    assert param_count(read_shape(reward_model_dir), "score") == numel(load_reward_model(reward_model_dir))


def test_parameter_count_qwen_style_bias_tied_and_grouped_query(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    assert param_count(read_shape(tmp_path)) == numel(model)


def test_lora_adapter_count_matches_peft(embedded_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_dir),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(read_shape(embedded_dir), 4) == trainable


def test_zero_stage_arithmetic():
    n, ranks = 1000, 4
    assert zero_bytes(n, 0, ranks, 4) == {"params": 4000, "grads": 4000, "optimizer": 8000}  # torch AdamW, no master
    assert zero_bytes(n, 0, ranks, 2) == {"params": 2000, "grads": 2000, "optimizer": 12000}  # bf16: fp32 master
    assert zero_bytes(n, 1, ranks, 4) == {"params": 4000, "grads": 4000, "optimizer": 12000 / 4}
    assert zero_bytes(n, 2, ranks, 4) == {"params": 4000, "grads": 4000 / 4, "optimizer": 12000 / 4}
    assert zero_bytes(n, 3, ranks, 4) == {"params": 4000 / 4, "grads": 4000 / 4, "optimizer": 12000 / 4}
    assert zero_bytes(n, 3, 8, 2) == {"params": 2000 / 8, "grads": 2000 / 8, "optimizer": 12000 / 8}
    assert zero_bytes(n, 3, ranks, 2, trainable=False) == {"params": 2000 / 4}  # LoRA's frozen base


def test_learner_offload_moves_optimizer_states_to_host(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    base = [f"model.policy={tmp_path}", "learner.gpus_per_rank=1", "learner.num_ranks=1", "model.dtype=bfloat16"]
    for stage, moved in ((2, {"optimizer"}), (3, {"optimizer", "params"})):
        on_gpu = estimate_roles(load_config(None, base + [f"learner.zero_stage={stage}"]))["learner"]
        offloaded = load_config(None, base + [f"learner.zero_stage={stage}", "learner.offload=true"])
        offload = estimate_roles(offloaded)["learner"]
        assert offload.peak < on_gpu.peak and offload.rss > on_gpu.rss
        assert {k.removesuffix(" (offloaded)") for k in offload.host if "offloaded" in k} == moved
    s = read_shape(tmp_path)  # checkpointing keeps one hidden state per layer plus one layer
    step = Pass(rows=1, length=100, positions=100)
    assert activation_bytes(s, step, 2, True, False) < activation_bytes(s, step, 2, False, False) / 10


@pytest.mark.parametrize("gib, code", [(80, 0), (24, 2)])
def test_colocated_7b_on_8_gpus_fits_80_gib_not_24(tmp_path, capsys, gib, code):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    args = ["plan", f"model.policy={tmp_path}", *COLOCATED_8_GPUS, "--cluster-resources", RESOURCES_8_GPUS,
            "--gpu-memory-gib", str(gib), "--prompt-tokens", "512"]
    assert main(args) == code
    out = capsys.readouterr().out
    assert ("fits" in out.splitlines()) == (code == 0)
    if code:
        assert any(line.strip().startswith("GPU memory: 8 GPUs need") for line in out.splitlines()), out
    assert main(args + ["--json"]) == code
    plan = json.loads(capsys.readouterr().out)
    # vLLM sleeps while the others score and learn: no phase holds every role's peak at once.
    peaks = sum(role["peak_bytes"] for role in plan["roles"].values())
    assert len(plan["gpus"]) == 8 and all(sum(gpu["roles"].values()) < peaks for gpu in plan["gpus"])
    assert plan["demand"]["GPU"] == 8 and plan["fits"] == (code == 0)


def test_fractional_shares_add_up_on_one_gpu():
    cfg = load_config(None, ["generators.gpus_per_worker=0.4", "generators.gpu_memory_utilization=0.3",
                             "learner.num_ranks=1", "learner.gpus_per_rank=0.4", "reference.gpus=0.1",
                             "reward.gpus=0.1"])
    est = estimate_roles(cfg, gpu_memory_gib=80)
    [(phase, load)] = gpu_loads(cfg, est)
    assert phase == "concurrent" and set(load) == {"generators", "reference", "reward", "learner"}
    assert load["generators"] == pytest.approx(0.3 * 80 * GiB + est["generators"].parts["CUDA context"])


def missing_lines(capsys, args: list[str]) -> list[str]:
    """``rayppo plan ARGS``' missing lines; none (and exit 0, ``fits``) when the job fits."""
    code = main(["plan", *args])
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.split("does not fit:\n")[1].splitlines()] if "does not fit:" in out else []
    assert (code, out.rstrip().endswith("fits")) == ((2, False) if lines else (0, True)), out
    return lines


def suggested(line: str) -> list[list[str]]:
    """The overrides of each fix a missing line suggests (the fixes follow ``Fix:``, split by ``, or``)."""
    return [re.findall(r"[a-z_]+\.[a-z_]+=\S+", fix) for fix in line.split(". Fix: ", 1)[1].split(", or ")]


def assert_each_fix_fits(capsys, args: list[str], line: str) -> None:
    """Every override fix in ``line``, applied to the same ``rayppo plan`` call, makes the job fit."""
    fixes = [fix for fix in suggested(line) if fix]
    assert fixes, line
    for fix in fixes:
        assert missing_lines(capsys, args + fix) == [], fix


MORE_ACTORS = ["generators.num=2", "learner.num_ranks=2"]
CPU_2_5 = ("CPU: need 2.5 (generators 2 x 0.5, reference 1 x 0.25, reward 1 x 0.25, learner 2 x 0.5), cluster has 2. "
           "Fix: ")
SHARES = ("smaller CPU shares: generators.cpus_per_worker=0.4 reference.cpus=0.2 reward.cpus=0.2 "
          "learner.cpus_per_rank=0.4, or fewer actors: generators.num=1")


def test_requested_resources_is_what_the_roles_reserve():
    assert requested_resources(load_config()) == {"CPU": 2.0}
    assert requested_resources(load_config(None, MORE_ACTORS)) == {"CPU": 2.5}
    # 3 x 0.1 is 0.30000000000000004 in floats; Ray counts to 0.0001
    assert requested_resources(load_config(None, ["reference.num=3", "reference.cpus=0.1"])) == {"CPU": 2.05}
    assert requested_resources(load_config(None, ["learner.resources={learner_node: 1}"])) == {"CPU": 2.0,
                                                                                               "learner_node": 2.0}
    # colocated: each learner rank's bundle holds its GPU once, the four roles' CPUs add up
    assert requested_resources(load_config(None, COLOCATED_8_GPUS)) == {"CPU": 8 * (0.5 + 0.5 + 0.25 + 0.25), "GPU": 8}
    across = load_config(None, ["generators.gpus_per_worker=2", "generators.tensor_parallel_layout=across_nodes",
                                "generators.num=2"])
    assert requested_resources(across)["GPU"] == 4  # vLLM's workers' bundles, the actor holds none


def test_local_instance_is_sized_to_the_roles_unless_num_cpus_is_set(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: no GPU
    huge = load_config(None, ["learner.cpus_per_rank=1000", "reference.cpus=0.1"])  # more than any machine's cores
    assert requested_resources(huge)["CPU"] == 2000.85
    cores = os.cpu_count()
    # Sized to the roles, in whole CPUs (Ray refuses fractions), up to 4 per core: past that, the fixes.
    assert local_resources(huge, with_memory=False)["CPU"] == MAX_OVERSUBSCRIPTION * cores
    [line] = preflight(huge)
    assert "cluster.num_cpus=2001 (" in line
    moderate = load_config(None, [f"learner.cpus_per_rank={cores}", "reference.cpus=0.1"])  # 2 x cores + 0.85
    assert local_resources(moderate, with_memory=False)["CPU"] == 2 * cores + 1
    assert preflight(moderate) == []
    assert local_resources(load_config(), with_memory=False)["CPU"] == max(os.cpu_count(), 2)
    [line] = preflight(load_config(None, MORE_ACTORS + ["cluster.num_cpus=2"]))
    assert line == CPU_2_5 + ("cluster.num_cpus=3 (oversubscribing this machine is fine: the stages of an iteration "
                              "take turns), or cluster.num_cpus=null (sized to what the roles reserve), or " + SHARES)


def test_cpu_shortage_on_this_machine_names_fixes_that_fit(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert missing_lines(capsys, MORE_ACTORS) == []  # unset, cluster.num_cpus follows the roles (3 on 2 cores)
    args = MORE_ACTORS + ["cluster.num_cpus=2"]
    [line] = missing_lines(capsys, args)  # this machine has the memory: the default job needs ~6 GiB of RSS
    assert line.startswith(CPU_2_5 + "cluster.num_cpus=3 (") and line.endswith(SHARES)
    assert [fix for fix in suggested(line) if fix] == [
        ["cluster.num_cpus=3"], ["cluster.num_cpus=null"],
        ["generators.cpus_per_worker=0.4", "reference.cpus=0.2", "reward.cpus=0.2", "learner.cpus_per_rank=0.4"],
        ["generators.num=1"]]
    assert_each_fix_fits(capsys, args, line)


def test_cpu_shortage_on_a_cluster_says_add_nodes_or_shrink(capsys):
    args = MORE_ACTORS + ["cluster.address=ray://head:10001", "--cluster-resources", '{"CPU": 2}']
    [line] = missing_lines(capsys, args)
    assert line == CPU_2_5 + "0.5 more CPUs (add nodes to the cluster), or " + SHARES
    assert_each_fix_fits(capsys, args, line)
    with pytest.raises(PlacementError, match=re.escape(line)):  # what the driver raises when it reserves
        check_capacity(load_config(None, MORE_ACTORS + ["cluster.address=ray://head:10001"]), {"CPU": 2.0})


@pytest.mark.parametrize("overrides, resources, expected", [
    (["learner.cpus_per_rank=4"], '{"CPU": 2}',
     "CPU: need 9 (generators 1 x 0.5, reference 1 x 0.25, reward 1 x 0.25, learner 2 x 4), cluster has 2. Fix: "
     "7 more CPUs (add nodes to the cluster), or smaller CPU shares: generators.cpus_per_worker=0.1 "
     "reference.cpus=0.05 reward.cpus=0.05 learner.cpus_per_rank=0.85"),
    (["generators.gpus_per_worker=1", "generators.num=2"], '{"CPU": 8, "GPU": 1}',
     "GPU: need 2 (generators 2 x 1), cluster has 1. Fix: 1 more GPU (add nodes to the cluster), or smaller GPU "
     "shares: generators.gpus_per_worker=0.5, or fewer actors: generators.num=1"),
    (["generators.gpus_per_worker=1", "learner.gpus_per_rank=1", "reference.gpus=1", "reward.gpus=1"],
     '{"CPU": 8, "GPU": 3}',
     "GPU: need 5 (generators 1 x 1, reference 1 x 1, reward 1 x 1, learner 2 x 1), cluster has 3. Fix: 2 more GPUs "
     "(add nodes to the cluster), or smaller GPU shares: generators.gpus_per_worker=0.3333 reference.gpus=0.3333 "
     "reward.gpus=0.3333"),
    (["learner.resources={learner_node: 1}"], '{"CPU": 8}',
     "learner_node: need 2 (learner 2 x 1), cluster has 0. Fix: 2 more learner_node (add nodes started with ray start "
     "--resources '{\"learner_node\": N}'), or no actor asking for it: learner.resources={}"),
    (["learner.resources={learner_node: 1}"], '{"CPU": 8, "learner_node": 1}',
     "learner_node: need 2 (learner 2 x 1), cluster has 1. Fix: 1 more learner_node (add nodes started with ray start "
     "--resources '{\"learner_node\": N}'), or fewer actors: learner.num_ranks=1, or no actor asking for it: "
     "learner.resources={}"),
    ([], '{"CPU": 8, "memory": 4e9}',
     "memory: need 4.1 GiB of RSS in total, cluster has 3.7 GiB (the generators take the most). Fix: fewer actors: "
     "learner.num_ranks=1"),
])
def test_shortfalls_exit_2_with_one_line_and_fixes_that_fit(capsys, overrides, resources, expected):
    args = [*overrides, "cluster.address=auto", "--cluster-resources", resources]
    assert missing_lines(capsys, args) == [expected]
    assert_each_fix_fits(capsys, args, expected)


def test_rss_no_config_can_fix_says_so(capsys):
    assert missing_lines(capsys, ["cluster.address=auto", "--cluster-resources", '{"CPU": 8, "memory": 1e9}']) == [
        "memory: need 4.1 GiB of RSS in total, cluster has 0.9 GiB (the generators take the most). Fix: nodes with "
        "more memory"]


@pytest.mark.parametrize("gib, extra, fix", [
    (40, [], "learner.offload=true"),
    (80, ["learner.zero_stage=2", "learner.gradient_checkpointing=false", "ppo.minibatches=1"],
     "learner.gradient_checkpointing=true learner.zero_stage=3"),  # neither alone is enough: both
])
def test_gpu_memory_fixes_are_computed_and_fit(tmp_path, capsys, gib, extra, fix):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    args = [f"model.policy={tmp_path}", *COLOCATED_8_GPUS, *extra, "--cluster-resources", RESOURCES_8_GPUS,
            "--gpu-memory-gib", str(gib), "--prompt-tokens", "512"]
    [line] = missing_lines(capsys, args)
    assert line.startswith("GPU memory: 8 GPUs need") and line.endswith(f"GiB. Fix: {fix}"), line
    assert_each_fix_fits(capsys, args, line)


def test_gpu_memory_from_the_clusters_accelerator_type():
    assert accelerator_gib({"GPU": 8, "accelerator_type:H100": 1}) == 81559 / 1024  # usable, not "80 GB"
    assert accelerator_gib({"GPU": 8, "accelerator_type:A100": 1}) is None  # 40 or 80 GiB: unknown
    assert accelerator_gib({"CPU": 8}) is None


def test_bad_cluster_resources_is_a_clear_error(capsys):
    assert main(["plan", "--cluster-resources", "{GPU: 8}"]) == 2
    assert "rayppo: error: --cluster-resources: not valid JSON" in capsys.readouterr().err


def test_json_output_parses(capsys):
    assert main(["plan", "--json", "--cluster-resources", '{"CPU": 4}']) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["missing"] == [] and plan["prompt_tokens"] == 4
    assert set(plan["roles"]) == {"generators", "reference", "reward", "learner"}
    assert all(r["peak_bytes"] > 0 and r["device"] == "cpu" for r in plan["roles"].values())
    assert plan["roles"]["learner"]["actors"] == 2 and plan["roles"]["learner"]["groups"] == ["learner"]


def test_the_plan_gives_each_stage_every_core_of_this_machine_and_says_why(monkeypatch, capsys):
    """Stages take turns on the machine rayppo would start: each stage's actors share its cores
    (the reference beside a verifier function has them all); on a cluster, or with overlapping
    stages, the CPU share."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert main(["plan", "--json"]) == 0
    roles = json.loads(capsys.readouterr().out)["roles"]
    assert {role: r["threads"] for role, r in roles.items()} == {"generators": 4, "reference": 4, "reward": 4,
                                                                 "learner": 2}
    assert main(["plan"]) == 0
    assert "threads: the stages take turns on this machine's 4 cores" in capsys.readouterr().out
    assert main(["plan", "--json", "rollout.max_staleness=1"]) == 0
    assert {r["threads"] for r in json.loads(capsys.readouterr().out)["roles"].values()} == {1}
    assert main(["plan", "--cluster-resources", '{"CPU": 8}']) == 0
    assert "threads: each actor's CPU share rounded down" in capsys.readouterr().out


def test_default_plan_answers_fast_without_torch():
    rayppo = Path(sys.executable).parent / "rayppo"
    start = time.perf_counter()
    out = subprocess.run([str(rayppo), "plan"], capture_output=True, text=True)
    print(f"rayppo plan: {time.perf_counter() - start:.2f} s")  # measured, not asserted (shared machines)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("fits"), out.stderr
    probe = ("import sys; from rayppo.config.load import load_config; from rayppo.plan.footprint import estimate_roles; "
             "estimate_roles(load_config()); print(sorted({'torch', 'transformers', 'ray'} & set(sys.modules)))")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def test_model_dir_matches_the_loader_without_torch(embedded_dir):
    from rayppo.models.loading import resolve_model_path

    assert model_dir("embedded") == resolve_model_path("embedded") == embedded_dir
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        model_dir("/nonexistent/model")


def test_train_stops_before_starting_anything_when_the_machine_lacks_resources(monkeypatch, capsys):
    import ray

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: no GPU
    assert main(["train", "generators.gpus_per_worker=1"]) == 2
    err = capsys.readouterr().err
    assert ("rayppo: error: this job does not fit: GPU: need 1 (generators 1 x 1), cluster has 0. Fix: a machine with "
            "1 GPU, or a Ray cluster with them (cluster.address), or CPUs only: generators.gpus_per_worker=0") in err
    assert not ray.is_initialized()


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {  # model_type -> (config class, model class, config fields): tiny random-init models
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", SMALL | {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", SMALL),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", SMALL | {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", SMALL | {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", SMALL | {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", SMALL),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", SMALL),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                "n_positions": 256}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"vocab_size": 128, "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2,
                                            "num_attention_heads": 4, "max_position_embeddings": 256,
                                            "word_embed_proj_dim": 64}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL),  # no grouped-query: num_key_value_heads unused
    "phi": ("PhiConfig", "PhiForCausalLM", SMALL),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", SMALL | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", SMALL | {"num_experts": 4, "num_experts_per_tok": 2,
                                                                    "moe_intermediate_size": 32,
                                                                    "shared_expert_intermediate_size": 48}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", SMALL | {"num_experts": 4, "num_experts_per_tok": 2,
                                                                    "moe_intermediate_size": 32, "head_dim": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_shape_is_read_under_its_own_names_and_counted_exactly(tmp_path, family):
    """GPT-2 names its context n_positions, OPT its MLP ffn_dim, Mixtral its experts
    num_local_experts: each is read under its own names, and the parameter count (LayerNorm biases,
    learned positions, ungated MLPs, every expert, routers, shared experts) equals the real model's."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    model.save_pretrained(tmp_path)
    shape = read_shape(tmp_path)
    assert (shape.family, shape.max_positions, shape.hidden, shape.layers, shape.vocab) == (family, 256, 64, 2, 128)
    assert shape.experts == fields.get("num_experts", fields.get("num_local_experts", 0))
    assert param_count(shape) == numel(model)


def test_the_generator_context_is_what_the_job_needs_not_the_models_whole_context(tmp_path):
    """vLLM refuses to start when one max_model_len sequence does not fit its KV cache. Llama 3.1
    8B names 131072 positions: 16 GiB of bf16 KV (32 layers x 2 x 8 heads x 128 x 2 bytes per
    token), which with 16 GiB of weights fills a 0.4 share of 80 GiB. By default the context is the
    longest prompt + rollout.max_new_tokens (within the model's), and the plan counts the batch's KV."""
    from rayppo.config.derived import generator_context

    assert generator_context(None, 131072, 100, 256) == 356
    assert generator_context(None, 300, 100, 256) == 300  # within the model's context
    assert generator_context(None, None, 100, 256) == 356  # a model that names none (ALiBi)
    assert generator_context(2048, 131072, 100, 256) == 2048  # generators.max_model_len wins
    llama31 = LLAMA_7B | {"intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256,
                          "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(llama31))
    base = [f"model.policy={tmp_path}", "model.dtype=bfloat16", "generators.gpus_per_worker=0.5",
            "generators.gpu_memory_utilization=0.4", "rollout.max_new_tokens=256", "rollout.batch_size=64"]
    by_default = estimate_roles(load_config(None, base), prompt_tokens=512)["generators"]
    assert by_default.problems == []
    assert by_default.kv_cache == 64 * (512 + 256) * 32 * 2 * 8 * 128 * 2  # the batch, at full length
    whole = estimate_roles(load_config(None, base + ["generators.max_model_len=131072"]), prompt_tokens=512)
    assert len(whole["generators"].problems) == 1
    assert "its profile run and the KV cache of one sequence of max_model_len=131072 tokens (16.00 GiB)" in whole["generators"].problems[0]


def test_zero_buckets_are_sized_to_the_model_and_counted_by_the_plan(tmp_path):
    """DeepSpeed's defaults (5e8-element buckets, doubled by overlap_comm at stage 3, and 1e9 live
    parameters) would hold ~4 GB per bf16 engine whatever the model; sized to a 7B Llama (h = 4096,
    a decoder layer of 202M parameters) they hold h^2 x 2 + 0.9 h^2 + one layer: ~0.5 GB."""
    from rayppo.learner.zero_sizes import bucket_bytes, zero_sizes

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    layer = 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    assert layer_params(read_shape(tmp_path)) == layer
    assert zero_sizes(4096, layer, 3) == {
        "reduce_bucket_size": 4096 ** 2, "allgather_bucket_size": 4096 ** 2,
        "stage3_prefetch_bucket_size": int(0.9 * 4096 ** 2), "stage3_param_persistence_threshold": 40960,
        "stage3_max_live_parameters": layer, "stage3_max_reuse_distance": layer}
    assert bucket_bytes(4096, layer, 3, 2) == (2 * 4096 ** 2 + int(0.9 * 4096 ** 2) + layer) * 2
    assert bucket_bytes(4096, layer, 2, 2) == 2 * 4096 ** 2 * 2  # reduce + all-gather, no overlap
    learner = estimate_roles(load_config(None, [f"model.policy={tmp_path}", "model.dtype=bfloat16",
                                                "learner.gpus_per_rank=1", "learner.zero_stage=3"]))["learner"]
    assert learner.parts["ZeRO buckets (policy + critic)"] == 2 * bucket_bytes(4096, layer, 3, 2)


def test_token_budgets_bound_the_passes_the_plan_counts(tmp_path):
    """Micro-batches by token budget: the learner's activations and the reference's and reward
    model's forward are counted for one pass of at most the budget's tokens, not a whole minibatch."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    base = [f"model.policy={tmp_path}", f"reward.model={tmp_path}", "reward.function=null", "model.dtype=bfloat16",
            "rollout.batch_size=512", "rollout.max_new_tokens=1024", "ppo.minibatches=4", "learner.num_ranks=1",
            "learner.gradient_checkpointing=false"]
    whole = estimate_roles(load_config(None, base + ["learner.micro_batch_tokens=0", "reference.micro_batch_tokens=0",
                                                     "reward.micro_batch_tokens=0"]), prompt_tokens=24)
    cut = estimate_roles(load_config(None, base + ["learner.micro_batch_tokens=8192", "reference.micro_batch_tokens=8192",
                                                   "reward.micro_batch_tokens=8192"]), prompt_tokens=24)
    s, length = read_shape(tmp_path), 24 + 1024
    # 128 rows x 1048 tokens a minibatch without a budget, 8192 tokens a pass with one (activations scale with tokens).
    ratio = (activation_bytes(s, Pass(8192 / length, length, 8192), 2, False, False)
             / activation_bytes(s, Pass(128, length, 128 * length), 2, False, False))
    assert cut["learner"].parts["activations"] == pytest.approx(whole["learner"].parts["activations"] * ratio)
    assert ratio == pytest.approx(8192 / (128 * length))
    # The scorers: 64 (reference) and reward.batch_size rows a pass without a budget, 8192 tokens with one.
    assert cut["reference"].peak < whole["reference"].peak and cut["reward"].peak < whole["reward"].peak
    assert pass_tokens(10, 50, 0) == 500 and pass_tokens(10, 50, 128) == 128 and pass_tokens(10, 500, 128) == 500


def test_plan_sizes_the_jobs_own_prompts_and_flags_fp32_billions_and_idle_gpus(tmp_path, embedded_dir, capsys):
    """Without --prompt-tokens the plan counts the job's own prompt file with the policy's
    tokenizer (not the embedded task's 4 tokens), says so, and notes what fits but is probably not
    meant: an fp32 policy of billions of parameters on GPUs, a model role on CPU while GPUs stay free."""
    policy = tmp_path / "llama"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps(LLAMA_7B))
    (policy / "tokenizer.json").write_bytes((embedded_dir / "tokenizer.json").read_bytes())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "say 1 :"}) + "\n" + json.dumps({"prompt": " ".join(["say"] * 300)}) + "\n")
    args = ["plan", f"model.policy={policy}", f"data.prompts={prompts}", "rollout.max_new_tokens=1024",
            "rollout.batch_size=2", "learner.gpus_per_rank=1", "generators.gpus_per_worker=1",
            "--cluster-resources", '{"GPU": 8, "CPU": 64}', "--gpu-memory-gib", "141"]
    main(args)
    out = capsys.readouterr().out
    assert f"301 prompt tokens (the longest of the 2 prompts of {prompts}) + 1024 response tokens" in out, out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert any("model.dtype=float32 for a 6.7B-parameter policy on GPUs" in n and "model.dtype=bfloat16" in n
               for n in notes), notes
    assert "note: reference runs on CPU while 5 GPUs stay free (reference.gpus=1)" in notes, notes
    main(args + ["model.dtype=bfloat16", "reference.gpus=1", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["advice"] == [] and plan["prompt_tokens"] == 301
    # A user's model on the embedded toy task: the longest the context allows, said.
    main(["plan", f"model.policy={policy}", "rollout.max_new_tokens=1024", "--cluster-resources", '{"CPU": 64}'])
    out = capsys.readouterr().out
    assert "3072 prompt tokens (upper bound max_model_len - rollout.max_new_tokens" in out, out
    assert "note: planned for 3072 prompt tokens, the longest the context allows" in out


def test_the_plan_counts_a_built_in_prompt_set_it_has_no_file_for(tmp_path, embedded_dir, capsys):
    """``data.prompts=arithmetic`` (the real model's recipe) is a set rayppo writes, not a file: the
    plan counts its prompts instead of planning the longest the context allows (8176 tokens of
    SmolLM2's context, a 23 GiB learner rank for the recipe)."""
    policy = tmp_path / "llama"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps(LLAMA_7B))
    (policy / "tokenizer.json").write_bytes((embedded_dir / "tokenizer.json").read_bytes())
    main(["plan", f"model.policy={policy}", "data.prompts=arithmetic", "rollout.max_new_tokens=16",
          "--cluster-resources", '{"CPU": 64}'])
    out = capsys.readouterr().out
    assert "prompts of arithmetic problems (chat template estimated)) + 16 response tokens" in out, out


def test_the_plan_suggests_one_learner_rank_on_this_machine_when_it_saves_memory():
    """On one machine's CPUs, stages taking turns, one rank on every core trained as fast as two
    (docs/benchmarks.md, Layouts): the plan suggests it when the estimate saves >= 1 GiB, and
    stays quiet where that does not hold (one rank already, overlapping stages, not this machine,
    threads set by the user, a saving too small to argue from)."""
    from rayppo.plan.footprint import inputs
    from rayppo.plan.layout import WORTH_SAYING, learner_layout_advice

    def advice(*overrides: str, cores: int | None = 2) -> list[str]:
        cfg = load_config(None, list(overrides))
        return learner_layout_advice(cfg, inputs(cfg, 64, 80.0), cores)

    big = ["rollout.batch_size=64", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=512"]
    cfg = load_config(None, big)
    two = 2 * estimate_roles(cfg, 64)["learner"].rss
    one = estimate_roles(load_config(None, big + ["learner.num_ranks=1"]), 64)["learner"].rss
    assert two - one >= WORTH_SAYING  # the case is one the rule speaks about
    (line,) = advice(*big)
    assert f"needs {(two - one) / GiB:.2f} GiB less memory than 2 ranks" in line and line.endswith("learner.num_ranks=1")
    assert advice(*big, "learner.num_ranks=1") == []
    assert advice(*big, "rollout.max_staleness=1") == []
    assert advice(*big, "learner.threads=1") == []
    assert advice(*big, cores=None) == []
    small = 2 * estimate_roles(load_config(None, []), 64)["learner"].rss - estimate_roles(
        load_config(None, ["learner.num_ranks=1"]), 64)["learner"].rss
    assert small < WORTH_SAYING and advice() == []


def test_a_lora_policy_needs_no_reference_actor_and_the_plan_says_what_that_saves(capsys):
    """With LoRA the reference is the policy's base on the learner: no reference actor, and a line
    naming the memory it would have taken; a reference model of its own brings the actor back.
    Adapter sync sends the adapter's bytes, not the policy's (the object-store copies shrink)."""
    est = estimate_roles(load_config(None, ["ppo.kl_coef=0.1"]), 64)
    assert main(["plan", "--json", "learner.lora_rank=4", "ppo.kl_coef=0.1"]) == 0
    roles = json.loads(capsys.readouterr().out)["roles"]
    assert roles["reference"]["actors"] == 0
    assert main(["plan", "learner.lora_rank=4", "ppo.kl_coef=0.1", "--prompt-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert (f"reference: the LoRA policy's base on the learner (its adapter off), no reference actor: "
            f"{est['reference'].peak / 2**20:.0f} MiB of RSS not needed") in out
    assert main(["plan", "--json", "learner.lora_rank=4", "ppo.kl_coef=0.1", "model.reference=embedded"]) == 0
    assert json.loads(capsys.readouterr().out)["roles"]["reference"]["actors"] == 1
    adapter = estimate_roles(load_config(None, ["learner.lora_rank=4"]), 64)["generators"].parts
    merged = estimate_roles(load_config(None, ["learner.lora_rank=4", "learner.lora_sync=merged"]), 64)["generators"].parts
    key = "weights from the object store (x2)"
    shape = read_shape(model_dir(load_config(None, []).model.policy))
    assert adapter[key] == 2 * lora_params(shape, 4) * 4 and merged[key] == 2 * param_count(shape) * 4
