"""Weight sync without Ray: learner-side sender and generator-side receivers in one process.

The sender (``rayppo/learner/broadcast_sender.py``) and a real vLLM CPU engine with rayppo's
weight-transfer engine (``rayppo/actors/weight_receiver.py``) form a gloo group over loopback, the
same code path the NCCL group takes on GPUs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.data.prompts import PromptBatch
from rayppo.learner.broadcast_sender import (
    SyncEndpoint,
    SyncLayout,
    WeightSender,
    free_port,
    open_sync_group,
    param_specs,
    receive_stream,
)
from rayppo.learner.guard import WeightSyncError, check_weights
from rayppo.models.fingerprint import sent_prints
from rayppo.models.loading import load_causal_lm, load_tokenizer
from rayppo.models.sequences import pack, policy_forward
from rayppo.models.weights import pack_weights

SAMPLING = SamplingSettings(max_new_tokens=6, temperature=0.9, ignore_eos=True)


def _endpoint(world_size: int) -> SyncEndpoint:
    return SyncEndpoint("gloo", "127.0.0.1", free_port(), world_size, timeout_s=60)


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """A random-init Llama with 256 positions: prompts of 160 tokens fill whole KV-cache blocks
    (128 tokens on CPU), so vLLM's prefix cache holds them between two generate calls."""
    from rayppo.models.embedded import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("long_context"), vocab_size=512, max_position_embeddings=256)


def _perturbed_state(model_dir) -> dict[str, torch.Tensor]:
    """The model's weights plus noise of their own spread: log-probs move by more than 0.01."""
    state = load_causal_lm(model_dir, "float32").state_dict()
    g = torch.Generator().manual_seed(1)
    return {k: v + v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 and v.std() > 0 else v.clone()
            for k, v in state.items()}


def _prompts(tokenizer) -> PromptBatch:
    texts = [" ".join(f"w{(i * 7 + j) % 300}" for j in range(160)) for i in range(4)]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert min(len(p) for p in ids) >= 150
    return PromptBatch(texts, ids)


def _mismatch(rollout, model, pad_id: int) -> float:
    """Largest |generator log-prob - log-prob recomputed by ``model``| over the rollout's tokens."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id)
    logprobs, _ = policy_forward(model, batch, SAMPLING.temperature)
    return max((logprobs[i, : len(lp)] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(rollout.logprobs))


def _sync_once(generator: GeneratorEngine, new_state: dict[str, torch.Tensor]) -> int:
    """Open a 2-rank group (sender + this generator) and broadcast ``new_state`` once."""
    endpoint = _endpoint(world_size=2)
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(WeightSender, endpoint, param_specs(new_state.items()), torch.device("cpu"))
        generator.join_weight_sync(endpoint, rank_offset=1)
        sender = sender.result()
        sent = pool.submit(sender.send, new_state.items())
        version = generator.receive_weights(SyncLayout(param_specs(new_state.items())), version=7)
        assert version == 7 and generator.policy_version == 7
        return sent.result()


@pytest.mark.slow
@pytest.mark.parametrize("backend, sync", [("vllm", "broadcast"), ("hf", "broadcast"), ("vllm", "object_store")])
def test_sync_makes_generator_sample_from_the_new_weights(backend, sync, long_context_dir, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tokenizer = load_tokenizer(long_context_dir)
    vllm = VLLMSettings(kv_cache_gib=1, collective_sync=True)
    generator = GeneratorEngine(str(long_context_dir), SAMPLING, backend=backend, actor=GeneratorActor(seed=0, vllm=vllm))
    new_state = _perturbed_state(long_context_dir)
    old_model = load_causal_lm(long_context_dir, "float32").eval()
    new_model = load_causal_lm(long_context_dir, "float32").eval()
    new_model.load_state_dict(new_state)
    pad = tokenizer.pad_token_id

    before = generator.generate(_prompts(tokenizer), seed=0)  # also fills vLLM's prefix cache
    assert _mismatch(before, old_model, pad) < 1e-4
    if sync == "broadcast":
        sent = _sync_once(generator, new_state)
        assert sent == sum(t.numel() * t.element_size() for t in new_state.values())
    else:
        assert generator.load_weights(pack_weights(new_state, version=7)) == 7
    # The generator holds exactly what was sent (fingerprints of its loaded, possibly fused and
    # repacked weights), and the check would fail against the old weights.
    assert check_weights(sent_prints(new_state), generator.weight_fingerprints(), 0, 7) == len(new_state)
    with pytest.raises(WeightSyncError, match="generator 0 does not hold"):
        check_weights(sent_prints(load_causal_lm(long_context_dir).state_dict()), generator.weight_fingerprints(), 0, 7)
    after = generator.generate(_prompts(tokenizer), seed=0)  # same prompts: cached KV must not be reused
    assert after.policy_version == [7] * 4
    assert _mismatch(after, new_model, pad) < 1e-4  # fp32: the generator runs exactly the sent weights
    assert _mismatch(after, old_model, pad) > 1e-2  # and they are not the old ones (the check can fail)


@pytest.mark.slow
def test_a_tied_head_of_its_own_in_vllm_is_loaded_by_the_broadcast_too(tokenizer, tmp_path, monkeypatch):
    """Gemma ties its head to the embedding: the learner sends the tensor once, under the
    embedding's name, and vLLM's Gemma holds the head as a module of its own sharing that
    parameter. The receiver loads the embedding under the head's name too; without it the head
    (not reprocessed on reload) keeps computing the logits from the old embedding on CPU."""
    import transformers

    from rayppo.learner.full_weights import full_tensors
    from rayppo.models.checkpoint_names import checkpoint_tensors

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=96, head_dim=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.GemmaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    old_model = transformers.GemmaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        for param in model.parameters():  # the tied matrix once
            param.add_(0.1 * param.std() * torch.randn_like(param))
    stream = {name: t.clone() for name, t in checkpoint_tensors(model, full_tensors(model))}
    assert "lm_head.weight" not in stream  # sent once, under the embedding's name
    generator = GeneratorEngine(str(tmp_path), SAMPLING, backend="vllm",
                                actor=GeneratorActor(seed=0, vllm=VLLMSettings(kv_cache_gib=1, collective_sync=True)))
    prompts = [tokenizer(t)["input_ids"] for t in ("say 7 :", "write 3 :", "give 1 :", "repeat 5 :")]
    _sync_once(generator, stream)
    after = generator.generate(PromptBatch(["p"] * 4, prompts), seed=0)
    assert _mismatch(after, model, tokenizer.pad_token_id) < 1e-4  # the head's logits moved with it
    assert _mismatch(after, old_model, tokenizer.pad_token_id) > 1e-2


def test_a_tied_head_is_streamed_under_every_name_the_engine_shares_it_by():
    """The stream (broadcast) and a CUDA-IPC run both gain the alias right after its source; an
    IPC alias reuses its source's handle; a run without the source is unchanged."""
    from rayppo.learner.broadcast_sender import IpcChunk
    from rayppo.models.weights import with_aliases

    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    stream = [("model.embed_tokens.weight", "E"), ("model.norm.weight", "N")]
    assert list(with_aliases(stream, aliases)) == [("model.embed_tokens.weight", "E"), ("lm_head.weight", "E"),
                                                   ("model.norm.weight", "N")]
    chunk = IpcChunk(["model.embed_tokens.weight"], ["float32"], [[8, 4]], [{"0": ("handle",)}], nbytes=128)
    aliased = chunk.with_aliases(aliases)
    assert aliased.names == ["model.embed_tokens.weight", "lm_head.weight"]
    assert aliased.ipc_handles == [{"0": ("handle",)}] * 2 and aliased.shapes == [[8, 4]] * 2
    assert aliased.nbytes == 128  # the same memory, mapped once
    layer = IpcChunk(["model.layers.0.mlp.up_proj.weight"], ["float32"], [[4, 4]], [{}])
    assert layer.with_aliases(aliases) is layer


def test_a_tie_is_a_parameter_of_two_modules_not_one_module_under_two_names():
    """vLLM's Qwen2-MoE registers one gate module twice (``mlp.shared_expert_gate`` and inside
    ``mlp.shared_expert``): not a tie. A head module sharing the embedding's parameter is one."""
    from rayppo.actors.held_weights import tied_aliases

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.head = torch.nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight
    model.gate = torch.nn.Linear(4, 1, bias=False)
    model.shared = torch.nn.Module()
    model.shared.gate = model.gate
    assert tied_aliases(model) == {"head.weight": "embed.weight"}


def test_sender_refuses_a_stream_whose_layout_changed():
    endpoint = _endpoint(world_size=2)
    named = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    with ThreadPoolExecutor(1) as pool:
        receiver = pool.submit(open_sync_group, endpoint, 1)
        sender = WeightSender(endpoint, param_specs(named.items()), torch.device("cpu"))
        group = receiver.result()
        with pytest.raises(RuntimeError, match="changed name, dtype or shape"):
            sender.send({"a": torch.ones(4), "b": torch.zeros(2, 2)}.items())
        received = pool.submit(lambda: dict(receive_stream(group, param_specs(named.items()), torch.device("cpu"))))
        assert sender.send(named.items()) == 3 * 4 + 4 * 4
        assert torch.equal(received.result()["a"], named["a"])


def test_unknown_sync_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="weight sync backend must be one of"):
        open_sync_group(SyncEndpoint("mpi", "127.0.0.1", 1, 2), 0)


def _two_gpus() -> bool:
    return os.environ.get("RAYPPO_GPU_TESTS") == "1" and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs (NCCL cannot join two ranks on one GPU); "
                                            "opt in with RAYPPO_GPU_TESTS=1")
def test_nccl_group_broadcasts_cuda_tensors():
    """The NCCL variant of the group: sender on GPU 0, receiver on GPU 1."""
    endpoint = SyncEndpoint("nccl", "127.0.0.1", free_port(), 2, timeout_s=60)

    def receive(group):
        torch.cuda.set_device(1)
        return dict(receive_stream(group, param_specs(named.items()), torch.device("cuda", 1)))

    named = {"w": torch.arange(6, dtype=torch.bfloat16, device="cuda:0").reshape(2, 3)}
    with ThreadPoolExecutor(1) as pool:
        receiver = pool.submit(open_sync_group, endpoint, 1)
        sender = WeightSender(endpoint, param_specs(named.items()), torch.device("cuda", 0))
        received = pool.submit(receive, receiver.result())
        sender.send(named.items())
        assert torch.equal(received.result()["w"].cpu(), named["w"].cpu())


def test_probe_rows_in_blocks_equal_the_whole_product(monkeypatch):
    """The weight probe converts a tensor to float64 one block of rows at a time (a whole 152k x 3584
    embedding would be 4.4 GB in float64 inside vLLM's headroom): the same rows to the bit (each
    row's sum is taken in one fixed order, whatever block it is in), within float64 summation
    order (K u64 sum|W_ik| per row) of the BLAS product."""
    import rayppo.models.fingerprint as fingerprint

    w = torch.randn(1000, 48, generator=torch.Generator().manual_seed(0))
    whole = fingerprint.probe_rows(w)  # one block
    monkeypatch.setattr(fingerprint, "PROBE_CHUNK_ELEMENTS", 48 * 7)  # blocks of 7 rows, the last short
    blocked = fingerprint.probe_rows(w)
    assert blocked.shape == (1000, 2) and torch.equal(blocked, whole)
    bound = 48 * torch.finfo(torch.float64).eps * w.double().abs().sum(dim=1, keepdim=True)
    assert bool(((blocked - w.double() @ fingerprint.probes(48)).abs() <= bound).all())


def test_rendezvous_ports_come_from_below_the_kernels_ephemeral_range():
    """A probed port is bound later by the store: one from bind(0) can be handed to another
    starting process meanwhile (a learner failed once with EADDRINUSE on 39551); ports below the
    ephemeral range are never handed out implicitly. Each is free, and processes draw apart."""
    import socket

    from rayppo.learner.broadcast_sender import EPHEMERAL_RANGE, free_port

    low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 32768
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports) and len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("", ports[-1]))  # free: the store can bind it
