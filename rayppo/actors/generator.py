"""The generator role: sample responses and report their old log-probs.

``GeneratorEngine`` holds the policy weights of one version and turns prompts into a ``Rollout``.
Two backends sample; both report log pi_old(y_t) under the *sampling* distribution, which is
what the learner recomputes as log_softmax(logits / temperature):

- ``vllm``: a vLLM engine in this process (``vllm_backend.py``), its log-probs taken after
  temperature scaling; new weights loaded in place, or a LoRA adapter that every request names.
- ``hf``: transformers ``generate`` and one forward pass for the log-probs, for models vLLM
  cannot load, and for the bit-for-bit comparison with the in-process trainer (``hf_backend.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from rayppo.actors.hf_backend import HFBackend, SamplingSettings, sample_seeds, split_response, stop_token_ids  # noqa: F401
from rayppo.actors.vllm_backend import VLLMBackend, VLLMSettings  # noqa: F401
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout

# SamplingSettings and split_response are imported from here by the roles' callers.
from rayppo.data.seeds import turn_seed
from rayppo.episodes.environment import EnvironmentPool
from rayppo.episodes.play import play_episodes
from rayppo.episodes.turn_loop import EpisodeSettings
from rayppo.learner.broadcast_sender import IpcChunk, SyncEndpoint, SyncLayout
from rayppo.learner.guard import HeldPrints
from rayppo.machine.role_resources import Engine, Resources, model_size
from rayppo.models.chat_tokens import check_template
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.weights import SyncFault, WeightsPayload, unpack_weights


def _seeds(seed: int, prompts: PromptBatch) -> list[int]:
    """Each row's sampling seed (``sample_seeds``); rows outside any group count as groups of one."""
    return sample_seeds(seed, prompts.groups or range(len(prompts)))


@dataclass(frozen=True)
class GeneratorActor:
    """Generator ``index`` of the fleet as a process: what sets it apart from the others, what it
    runs on and how its vLLM engine is built (the in-process trainer's: the defaults, its device)."""

    index: int = 0
    """Its place in the fleet; every row it samples carries it (``Rollout.generator_id``)."""
    seed: int = 0
    """Its vLLM engine's seed (``settings.generator_seed``); no response draws from it (each row has its own)."""
    vllm: VLLMSettings | None = None
    """The vLLM engine's arguments (``backend="vllm"``); None: the defaults."""
    resources: Resources = Resources()
    """Its torch threads and GPUs."""
    sync_fault: SyncFault = SyncFault()
    """Testing only: a broken weight load, on purpose (``checks.sync_fault``)."""


class GeneratorEngine(Engine):
    """Samples responses with the policy weights it holds (``policy_version``)."""

    def __init__(self, model_path: str, sampling: SamplingSettings, backend: str = "hf", dtype: str = "float32",
                 episodes: EpisodeSettings | None = None, actor: GeneratorActor = GeneratorActor()):
        self.set_threads(actor.resources.threads)
        # vLLM places its own workers on the actor's GPUs; CUDA stays uninitialised here so that
        # its mp executor can start tensor-parallel workers.
        self.init_device(actor.resources.gpus, "generators", make_current=backend != "vllm")
        self.sync_fault = actor.sync_fault  # testing only: a broken weight load, on purpose
        self.serves_adapter = False  # the syncs send LoRA adapters (learner.lora_sync=adapter)
        self.sent_shapes: dict[str, list[int]] = {}
        model_path = str(resolve_model_path(model_path))  # "embedded" is built on this node if needed
        self.tokenizer = load_tokenizer(model_path)
        self.sampling = sampling
        self.generator_id = actor.index
        self.policy_version = 0
        self.episodes = episodes  # multi-turn: every prompt starts an episode with rollout.environment
        self._pool: EnvironmentPool | None = None
        eos_ids = stop_token_ids(self.tokenizer, model_path)
        self.turn_end_ids: list[int] = []  # the stop tokens that end a turn of an episode
        if episodes is not None:  # refused before the engine loads: a template that rewrites earlier turns
            texts = {self.tokenizer.decode([i]): i for i in eos_ids}
            self.turn_end_ids = [texts[t] for t in check_template(self.tokenizer, list(texts), episodes.observation_role)]
        self.backend: VLLMBackend | HFBackend
        if backend == "vllm":
            self.backend = VLLMBackend(model_path, dtype, actor.vllm or VLLMSettings(), actor.seed, eos_ids)
        elif backend == "hf":
            self.backend = HFBackend(model_path, dtype, self.tokenizer, eos_ids, self.device)
        else:
            raise ValueError(f"generators.backend must be 'vllm' or 'hf', got {backend!r}")

    def load_weights(self, payload: WeightsPayload) -> int:
        """Take the learner's new weights; later rollouts carry their version. Returns it."""
        named = unpack_weights(payload)
        self.sent_shapes = {name: list(t.shape) for name, t in named.items()}
        if payload.adapter is not None:
            self._load_adapter(payload.version, named, payload.adapter)
        elif self.sync_fault.kind != "skip_all":
            self.backend.load_weights(dict(self.sync_fault.apply(named.items())))
        self.policy_version = payload.version
        return self.policy_version

    def _load_adapter(self, version: int, named: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve the LoRA adapter of ``version`` on the base this engine loaded (``learner.lora_sync``)."""
        self.serves_adapter = True
        if self.sync_fault.kind != "skip_all":  # the fault: the previous adapter stays in use
            self.backend.load_adapter(version, dict(self.sync_fault.apply(named.items())), config)
        self._drop_adapter_fault()

    def _drop_adapter_fault(self) -> None:
        if self.sync_fault.kind == "drop_adapter":  # the fault: requests name no adapter
            self.backend.adapter = None

    def join_weight_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        """Join learner rank 0's sync group (blocks until every member has joined)."""
        self.backend.join_sync(endpoint, rank_offset)

    def start_ipc_update(self) -> None:
        """Colocated CUDA-IPC sync: open a weight update (``load_ipc`` for each run, then finish)."""
        if self.sync_fault.kind != "none":
            raise ValueError("checks.sync_fault is not implemented for the CUDA-IPC weight sync")
        self.sent_shapes = {}
        assert isinstance(self.backend, VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.start_ipc()

    def load_ipc(self, chunk: IpcChunk) -> None:
        """Load one run of tensors that the learner rank on this GPU shares by CUDA-IPC (with
        adapter sync: the adapter, registered when the update finishes)."""
        self.sent_shapes.update(zip(chunk.names, chunk.shapes))
        self.serves_adapter = chunk.adapter is not None
        assert isinstance(self.backend, VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.load_ipc(chunk)

    def finish_ipc_update(self, version: int) -> int:
        """Close the weight update; later rollouts carry ``version``. Returns it."""
        assert isinstance(self.backend, VLLMBackend)  # weight_sync_backend picks the CUDA-IPC sync for vllm only
        self.backend.finish_ipc(version)
        self.policy_version = version
        return version

    def receive_weights(self, layout: SyncLayout, version: int) -> int:
        """Take the weights of ``version`` from the sync group's broadcast: the full policy, or
        with adapter sync (``layout.adapter``) the LoRA adapter to serve. Returns the version."""
        self.sent_shapes = {spec.name: list(spec.shape) for spec in layout.specs}
        if layout.adapter is None:
            self.backend.receive(layout.specs, self.sync_fault)
        else:
            self.serves_adapter = True
            self.backend.receive_adapter(version, layout.specs, layout.adapter, self.sync_fault)
            self._drop_adapter_fault()
        self.policy_version = version
        return version

    def weight_fingerprints(self) -> HeldPrints | None:
        """Fingerprints of the weights this engine holds now, under the names of the last sync
        (``rayppo/models/fingerprint.py``): the generator's half of the weight check; one dict
        per worker for a tensor-parallel generator's adapter. None when the engine cannot be
        fingerprinted (full weights on tensor-parallel vLLM, for now)."""
        if self.serves_adapter:
            return self.backend.adapter_prints()
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
        if isinstance(self.backend, VLLMBackend):
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
