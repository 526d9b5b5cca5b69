"""The generator role: sample responses and report their old log-probs.

``GeneratorEngine`` holds the policy's current weights (with a version number) and turns a
batch of prompts into a ``Rollout``. Backends:

- ``hf``: transformers ``generate``, then one forward pass for the log-probs (exactly the
  learner's computation: log_softmax(logits / temperature)).
"""

from __future__ import annotations

import torch

from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.models.loading import load_causal_lm, load_tokenizer
from rayppo.models.sequences import pack, policy_forward


class EmptyResponseError(RuntimeError):
    """A generator produced a response with no tokens; the message names the prompt."""


def split_response(tokens: list[int], eos_id: int, pad_id: int) -> tuple[list[int], str]:
    """Cut a generated row after its first EOS: ``(response ids with EOS, finish reason)``."""
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1], "stop"
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens = tokens[:-1]
    return tokens, "length"


class GeneratorEngine:
    """Samples responses with the policy weights it holds (``policy_version``)."""

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        generator_id: int = 0,
    ):
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, dtype).eval()
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.generator_id = generator_id
        self.policy_version = 0

    def load_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Take the learner's new weights; later rollouts carry ``version``."""
        self.model.load_state_dict(named_tensors, strict=True)
        self.policy_version = version

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """One response per prompt, sampled at the configured temperature / top-p."""
        tok = self.tokenizer
        width = max(len(p) for p in prompts.ids)
        input_ids = torch.full((len(prompts.ids), width), tok.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompts.ids):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        rows = [split_response(row.tolist(), tok.eos_token_id, tok.pad_token_id) for row in out[:, width:]]
        response_ids = [ids for ids, _ in rows]
        for text, ids in zip(prompts.texts, response_ids):
            if not ids:
                raise EmptyResponseError(f"generator {self.generator_id} returned an empty response for prompt {text!r}")
        logprobs, _ = policy_forward(self.model, pack(prompts.ids, response_ids, tok.pad_token_id), self.temperature)
        return Rollout(
            prompt_ids=[list(p) for p in prompts.ids],
            response_ids=response_ids,
            logprobs=[row[: len(ids)].tolist() for row, ids in zip(logprobs, response_ids)],
            finish_reason=[reason for _, reason in rows],
            prompt_text=list(prompts.texts),
            response_text=tok.batch_decode(response_ids, skip_special_tokens=True),
            policy_version=[self.policy_version] * len(response_ids),
            generator_id=[self.generator_id] * len(response_ids),
        )
