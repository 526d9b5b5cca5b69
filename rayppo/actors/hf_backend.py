"""The generator's transformers backend, and what both backends share.

``HFBackend`` samples with transformers' ``generate`` and scores the sampled tokens with one
forward pass (``models.sequences.policy_forward``), for models vLLM cannot load and for the
bit-for-bit comparison with the in-process trainer. ``SamplingSettings``, ``sample_seeds``,
``stop_token_ids`` and ``split_response`` are the vLLM backend's too (``generator.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rayppo.data.seeds import row_seeds
from rayppo.learner.adapter_weights import adapter_tensors, engine_form, peft_param_name, scaling, wrap_lora
from rayppo.learner.broadcast_sender import ParamSpec, SyncEndpoint, SyncGroup, open_sync_group, receive_stream
from rayppo.models.fingerprint import held_prints
from rayppo.models.loading import load_causal_lm
from rayppo.models.sequences import pack, policy_forward
from rayppo.models.weights import SyncFault


@dataclass
class SamplingSettings:
    """How responses are sampled (the rollout section of the config)."""

    max_new_tokens: int
    temperature: float = 1.0
    ignore_eos: bool = False
    """Always generate ``max_new_tokens`` (fixed-length benchmarks)."""
    # No top-p / top-k: the learner scores log_softmax(logits / T), so that is what is sampled.


def sample_seeds(seed: int, groups: Sequence[int]) -> list[int]:
    """The sampling seed of each row of a call (``data/seeds.row_seeds``): a function of the call's
    ``seed`` (``data/seeds.rollout_seed`` ...), the row's group (its prompt's place in the whole
    batch, ``PromptBatch.groups``) and its place among that group's rows; not of the generator that
    samples it, nor of how many generators there are. So G generators draw the rollout one draws,
    and a run resumed on another ``generators.num`` goes on as it would have (docs/cluster.md,
    "Sampling noise")."""
    return row_seeds(seed, groups)


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's ``generation_config``
    EOS list (what vLLM stops on), so both backends end responses on the same tokens."""
    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(i for i in ids if i is not None)


def split_response(tokens: list[int], eos_ids: list[int]) -> tuple[list[int], str]:
    """Cut a generated row after its first EOS: ``(response ids with EOS, finish reason)``.
    ``generate`` pads a row only after its EOS, so a row without one is all samples: a pad id in
    it is a token the policy drew."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


class HFBackend:
    """transformers' ``generate`` and one forward pass for the log-probs (module docstring)."""

    def __init__(self, model_path: str, dtype: str, tokenizer, eos_ids: list[int], device: torch.device):
        self.model = load_causal_lm(model_path, dtype).to(device).eval()
        self.device = device
        # transformers fills every unset field of a generate() call from the model's own
        # generation_config (repetition_penalty, no_repeat_ngram_size, suppress_tokens, ...), and
        # each of those would change what is sampled without changing the recorded log-probs.
        # A fresh config holds only rayppo's settings.
        self.model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.sync_group: SyncGroup | None = None
        self.adapter: int | None = None  # the policy version of the LoRA adapter held (adapter sync)
        self.adapter_config: dict[str, Any] = {}

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        # Tensors not given keep their values (what the correctness guard's weight check is for).
        unexpected = self.model.load_state_dict(named, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"weight sync: the policy has no tensors named {unexpected[:3]}")

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve the LoRA adapter of ``version``: the model wrapped by peft once, as the learner's
        policy is (``learner/learner_engine.py``), then each sync's A and B copied into it; its forward is
        the learner's, W x + s B (A x), not a merged W'."""
        if not self.adapter_config:  # the first adapter: wrap once (a fault may set ``adapter`` back to None)
            self.model = wrap_lora(self.model, config)
        own = {peft_param_name(name): t for name, t in tensors.items()}
        unexpected = self.model.load_state_dict(own, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"adapter sync: the policy has no LoRA tensors named {unexpected[:3]}")
        self.adapter, self.adapter_config = version, config

    def adapter_prints(self) -> dict[str, tuple[float, float]]:
        """Fingerprints of the adapter held, B with its scaling folded in as vLLM holds it
        (``adapter_weights.engine_form``), under peft's checkpoint names."""
        if self.adapter is None:
            return {}
        s = scaling(self.adapter_config)
        named = dict(adapter_tensors(self.model))
        return held_prints({name: engine_form(name, t, s) for name, t in named.items()})

    def join_sync(self, endpoint: SyncEndpoint, rank_offset: int) -> None:
        self.sync_group = open_sync_group(endpoint, rank_offset)

    def receive(self, specs: list[ParamSpec], fault: SyncFault) -> None:
        if self.sync_group is None:
            raise RuntimeError("receive_weights before join_weight_sync: not in a sync group")
        self.load_weights(dict(fault.apply(receive_stream(self.sync_group, specs, self.model.device))))

    def receive_adapter(self, version: int, specs: list[ParamSpec], config: dict[str, Any], fault: SyncFault) -> None:
        """The adapter of ``version`` from the sync group's broadcast (every broadcast received;
        a fault that loads nothing keeps the previous adapter)."""
        if self.sync_group is None:
            raise RuntimeError("receive_weights before join_weight_sync: not in a sync group")
        tensors = dict(fault.apply(receive_stream(self.sync_group, specs, self.model.device)))
        if tensors:
            self.load_adapter(version, tensors, config)

    def held_prints(self, shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
        state = self.model.state_dict()
        return held_prints({name: state[name] for name in shapes if name in state})

    @staticmethod
    def sleep() -> bool:
        return False  # transformers keeps its weights where they are

    @staticmethod
    def wake_up(tags: list[str]) -> bool:
        return False

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings, seeds: list[int],
               limits: list[int] | None = None):
        # The in-process trainer samples from the module it trains: eval mode here keeps the KV
        # cache on (transformers turns it off under gradient checkpointing in train mode).
        training = self.model.training
        self.model.eval()
        try:
            return self._sample(prompt_ids, s, seeds, limits)
        finally:
            self.model.train(training)

    def _sample(self, prompt_ids: list[list[int]], s: SamplingSettings, seeds: list[int], limits: list[int] | None):
        tok = self.tokenizer
        limits = limits or [s.max_new_tokens] * len(prompt_ids)
        longest = max(limits, default=s.max_new_tokens)
        batch = pack(prompt_ids, [[]] * len(prompt_ids), tok.pad_token_id).to(self.device)
        width = batch.prompt_width
        out = self.model.generate(
            input_ids=batch.input_ids[:, :width],
            attention_mask=batch.attention_mask[:, :width],
            # Greedy decoding of scores that RowNoise has perturbed: a sample from each row's own
            # noise. Temperature 0: plain greedy decoding (evaluation); its log-probs below are at T = 1.
            do_sample=False, temperature=None, top_p=None, top_k=None,
            logits_processor=LogitsProcessorList([RowNoise(seeds, s.temperature)] if s.temperature > 0 else []),
            max_new_tokens=longest, min_new_tokens=longest if s.ignore_eos else 0,
            eos_token_id=self.eos_ids, pad_token_id=tok.pad_token_id,
        )
        eos_ids = [] if s.ignore_eos else self.eos_ids
        # One generate() for the batch, each row then cut at its own limit: the tokens a row would
        # have sampled past it are dropped, which changes nothing before the cut.
        rows = [split_response(row[:limit].tolist(), eos_ids)
                for row, limit in zip(out[:, width:], limits)]
        response_ids = [ids for ids, _ in rows]  # each at least one token: generate() samples one or more
        logprobs, _ = policy_forward(self.model, pack(prompt_ids, response_ids, tok.pad_token_id).to(self.device),
                                     s.temperature or 1.0)
        return response_ids, [lp[: len(ids)].tolist() for lp, ids in zip(logprobs, response_ids)], [r for _, r in rows]


class RowNoise(LogitsProcessor):
    """Turns greedy decoding into sampling from softmax(logits / T), each row with noise from its
    own seed: argmax_v(logits_v / T + g_v) with g_v ~ Gumbel(0, 1) i.i.d. is a draw from
    softmax(logits / T) (the Gumbel-max trick: Gumbel 1954; Maddison, Tarlow & Minka 2014). One
    generator per row, so a row's sample does not depend on the other rows of the batch, as in
    vLLM with per-request seeds."""

    def __init__(self, seeds: list[int], temperature: float):
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` [B, V] -> [B, V] fp32 perturbed scores (a -inf score stays -inf)."""
        vocab = scores.shape[-1]
        # -log E with E ~ Exp(1) is Gumbel(0, 1); drawn on the CPU, where every row's generator lives.
        # E is kept above 0 (a 0 would be +inf noise, and NaN on a -inf score).
        tiny = torch.finfo(torch.float32).tiny
        noise = torch.stack([-torch.empty(vocab).exponential_(generator=g).clamp_min_(tiny).log()
                             for g in self.generators])
        return scores.float() / self.temperature + noise.to(scores.device)
