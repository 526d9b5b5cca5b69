"""Forward passes over (prompt, response) pairs: per-token log-probs, entropies and values.

A batch is laid out as ``[left-padded prompt | right-padded response]`` so that every response
starts at the same column P. Position ids are counted from each row's first real token, so the
padding changes nothing: a row's numbers are the same alone or in any batch.

Response position t (0-based) is predicted by the hidden state at column ``P - 1 + t``; that
column also gives ``values[:, t] = V(S_{t-1})``. The state after the last valid token, S_T, sits
at column ``P - 1 + len``: its value is the bootstrap for truncated responses.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from rayppo.models.packing import RowPacking, pack_sequences, unpack
from rayppo.models.shared_prompts import pack_shared
from rayppo.models.vocab_head import HeadPass, token_logprobs, top_logprobs
from rayppo.token_math import entropy_from_logits, logprobs_from_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class PackedBatch:
    """Token tensors for one forward pass over B (prompt, response) pairs."""

    input_ids: torch.Tensor
    """[B, P + T] long: left-padded prompts then right-padded responses."""
    attention_mask: torch.Tensor
    """[B, P + T] long: 1 on real tokens."""
    position_ids: torch.Tensor
    """[B, P + T] long: positions counted from each row's first real token."""
    response_ids: torch.Tensor
    """[B, T] long: the responses, right-padded with ``pad_id``."""
    mask: torch.Tensor
    """[B, T] float: 1 on real response tokens."""
    prompt_width: int
    """P: the column where every response starts."""
    packing: RowPacking | None = None
    """When set, the model runs on these padding-free rows (``packed``) and its outputs are put
    back in this layout; ``rows`` and ``trimmed`` drop it (``trimmed`` packs again, by ``pack_mode``)."""
    pack_mode: str = ""
    """How ``trimmed`` packs its rows: ``""`` not at all, ``"rows"`` in rows as wide as the longest
    sequence (SDPA, eager), ``"one_row"`` all in one row (flash-attention's varlen kernel),
    ``"varlen"`` all in one row with per-sequence SDPA (``models/varlen_attention.py``),
    ``"right_padded"`` one sequence per row from column 0 (no attention mask)."""
    response_mask: torch.Tensor | None = None
    """[B, T] float: 1 on every real token after the prompt, observations included (multi-turn);
    None: ``mask`` (single-turn rows, where the two are the same)."""

    @property
    def token_mask(self) -> torch.Tensor:
        """[B, T]: 1 on every real response token (what a row's length counts)."""
        return self.mask if self.response_mask is None else self.response_mask

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.response_ids.to(device),
            self.mask.to(device),
            self.prompt_width,
            None if self.packing is None else self.packing.to(device),
            self.pack_mode,
            None if self.response_mask is None else self.response_mask.to(device),
        )

    def packed(self, mode: str = "rows") -> PackedBatch:
        """The same batch, its forward run on the rows of ``models.packing.pack_sequences(mode)``; under
        ``varlen`` rows with the same prompt share its columns (``models.shared_prompts``)."""
        if mode == "varlen":
            return dataclasses.replace(self, packing=pack_shared(self.input_ids, self.attention_mask, self.prompt_width))
        return dataclasses.replace(self, packing=pack_sequences(self.input_ids, self.attention_mask, mode))

    @property
    def processed_tokens(self) -> int:
        """Tokens the forward pass runs on, padding included."""
        return self.input_ids.numel() if self.packing is None else self.packing.processed_tokens

    def model_inputs(self) -> dict[str, Any]:
        """The keyword inputs of one forward: the packed rows' (``RowPacking.model_inputs``) or
        the padded ones."""
        if self.packing is not None:
            return self.packing.model_inputs()
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def unpacked(self, outputs: torch.Tensor) -> torch.Tensor:
        """A forward's ``[rows, width, ...]`` outputs in this batch's ``[B, P + T, ...]`` layout."""
        return outputs if self.packing is None else unpack(outputs, self.packing)

    def rows(self, index: torch.Tensor | slice) -> PackedBatch:
        """The sub-batch of the given rows (columns are kept, so P stays the same)."""
        return PackedBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.position_ids[index],
            self.response_ids[index],
            self.mask[index],
            self.prompt_width,
            pack_mode=self.pack_mode,
            response_mask=None if self.response_mask is None else self.response_mask[index],
        )

    def trimmed(self) -> PackedBatch:
        """The same rows without the columns that are padding in every row: the prompt part cut
        to its longest prompt, the response part to its longest response (at least one column).
        Position ids count from each row's first real token, so no row's numbers change. With a
        ``pack_mode`` the rows are also packed without padding (``packed``)."""
        prompt_width = int(self.attention_mask[:, : self.prompt_width].sum(dim=1).max())
        response_width = max(int(self.token_mask.sum(dim=1).max()), 1)
        columns = slice(self.prompt_width - prompt_width, self.prompt_width + response_width)
        cut = PackedBatch(
            self.input_ids[:, columns],
            self.attention_mask[:, columns],
            self.position_ids[:, columns],
            self.response_ids[:, :response_width],
            self.mask[:, :response_width],
            prompt_width,
            pack_mode=self.pack_mode,
            response_mask=None if self.response_mask is None else self.response_mask[:, :response_width],
        )
        return cut.packed(self.pack_mode) if self.pack_mode else cut

    def lengths(self) -> tuple[list[int], list[int]]:
        """``(prompt lengths, response lengths)`` of the rows, in tokens."""
        prompt = self.attention_mask[:, : self.prompt_width].sum(dim=1)
        return prompt.tolist(), self.token_mask.sum(dim=1).long().tolist()


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
         action_mask: list[list[int]] | None = None) -> PackedBatch:
    """Lay out B (prompt, response) pairs for one forward pass. ``action_mask`` ([B][T_b], a
    multi-turn episode's ``Rollout.action_mask``; None or empty: single-turn) makes ``mask`` the
    action tokens and keeps every real token in ``response_mask``."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    batch = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(max((len(r) for r in response_ids), default=0), 1)
    input_ids = torch.full((batch, width_p + width_r), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    mask = torch.zeros((batch, width_r), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        input_ids[i, width_p : width_p + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, width_p - len(p) : width_p + len(r)] = 1
        mask[i, : len(r)] = 1.0
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    response_mask = None
    if action_mask:
        response_mask, mask = mask, mask.clone()
        for i, actions in enumerate(action_mask):
            mask[i, : len(actions)] = torch.tensor(actions, dtype=torch.float32)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_ids=input_ids[:, width_p:].clone(),
        mask=mask,
        prompt_width=width_p,
        response_mask=response_mask,
    )


def _response_slice(batch: PackedBatch) -> slice:
    """Columns whose outputs predict the response tokens: P - 1 .. P + T - 2."""
    width_r = batch.response_ids.shape[1]
    return slice(batch.prompt_width - 1, batch.prompt_width - 1 + width_r)


def policy_forward(
    model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [B, T], entropy [B, T] or None)`` of the response tokens under ``model``.

    Logits are divided by the sampling temperature, the same transformation the sampler
    applied, so these match the old log-probs a generator reports. Padding positions are 0.
    ``entropy_grad=False`` computes the entropy as a statistic only: no autograd graph through a
    softmax over the whole vocabulary (with a zero entropy bonus that backward is pure cost).

    The model runs without its vocabulary projection; ``vocab_head.token_logprobs`` projects only
    the valid response positions, a chunk of tokens at a time, so no ``[B, T, V]`` tensor exists.
    ``model`` may be a transformers causal LM, or one wrapped by PEFT or DeepSpeed (whose forward
    is still the one called, so its hooks run). Model types not known to compute their logits as
    exactly ``h W^T`` (``PLAIN_HEAD_MODELS``) take the full-logits path.
    """
    out = policy_forward_at(model, batch, None, temperature, with_entropy, entropy_grad)
    return out.logprobs, out.entropy


class ResponseLogprobs(NamedTuple):
    """A policy's forward over the response tokens (0 on padding)."""

    logprobs: torch.Tensor
    """[B, T] log pi(y_t | S_{t-1}) of the sampled tokens."""
    entropy: torch.Tensor | None
    """[B, T] H(pi(. | S_{t-1})); None when not asked for."""
    at_ids: torch.Tensor | None
    """[B, T, k] log pi(j | S_{t-1}) at the k ids given per position (a teacher's top ids); None without them."""


def policy_forward_at(
    model: torch.nn.Module, batch: PackedBatch, ids: torch.Tensor | None, temperature: float = 1.0,
    with_entropy: bool = False, entropy_grad: bool = True,
) -> ResponseLogprobs:
    """``policy_forward``, and with ``ids`` [B, T, k] also log pi at those k tokens of every
    response position (the student's side of the top-k distillation term), from the same pass:
    the sampled token and the k others are m = k + 1 targets of one head pass."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None or not _plain_logits(lm):
        return _full_logits_forward(model, batch, ids, temperature, with_entropy, entropy_grad)
    hidden, valid = _response_hidden(model, lm, batch)
    targets = batch.response_ids[valid].unsqueeze(1)
    if ids is not None:
        targets = torch.cat([targets, ids[:, : valid.shape[1]][valid].to(targets.dtype)], dim=1)
    logprobs, entropy = token_logprobs(hidden, head, targets, HeadPass(temperature, with_entropy, entropy_grad))
    zeros = torch.zeros(batch.mask.shape, dtype=logprobs.dtype, device=batch.mask.device)
    at_ids = None
    if ids is not None:
        at_ids = logprobs.new_zeros((*batch.mask.shape, ids.shape[-1]))
        at_ids[valid] = logprobs[:, 1:]
    return ResponseLogprobs(zeros.masked_scatter(valid, logprobs[:, 0]),
                            None if entropy is None else zeros.masked_scatter(valid, entropy), at_ids)


@torch.no_grad()
def top_forward(model: torch.nn.Module, batch: PackedBatch, k: int, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [B, T], top_logprobs [B, T, k], top_ids [B, T, k])``: the sampled tokens' log-probs
    under ``model`` and, at every response position, its k most likely tokens and their log-probs
    (``vocab_head.top_logprobs``; 0 and id 0 on padding). A distillation teacher's pass."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    valid = batch.mask.bool()
    if head is None or not _plain_logits(lm):
        logsoftmax = torch.log_softmax(_response_logits(model, batch, temperature), dim=-1)
        top, ids = logsoftmax.topk(k, dim=-1)
        sampled = logsoftmax.gather(-1, batch.response_ids.long().unsqueeze(-1)).squeeze(-1)
        keep = valid.unsqueeze(-1)
        return sampled * batch.mask, top * keep, ids * keep
    hidden, _ = _response_hidden(model, lm, batch)
    sampled, top, ids = top_logprobs(hidden, head, k, batch.response_ids[valid], temperature)
    logprobs = torch.zeros(batch.mask.shape, dtype=sampled.dtype, device=batch.mask.device)
    top_full = top.new_zeros((*batch.mask.shape, k))
    ids_full = ids.new_zeros((*batch.mask.shape, k))
    top_full[valid], ids_full[valid] = top, ids
    return logprobs.masked_scatter(valid, sampled), top_full, ids_full


def _response_hidden(model: torch.nn.Module, lm: PreTrainedModel, batch: PackedBatch
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [N, H], valid [B, T])``: the decoder's last hidden states at the N valid response
    positions, from ``model``'s forward with the causal LM's own projection skipped."""
    captured: list[torch.Tensor] = []
    handle = lm.get_decoder().register_forward_hook(lambda _m, _args, out: captured.append(_last_hidden(out)))
    try:
        model(**batch.model_inputs(), use_cache=False, logits_to_keep=_NO_POSITIONS.to(batch.input_ids.device))
    finally:
        handle.remove()
    valid = batch.mask.bool()
    return batch.unpacked(captured[-1])[:, _response_slice(batch)][valid], valid


_NO_POSITIONS = torch.zeros(0, dtype=torch.long)
"""``logits_to_keep`` that keeps no position: the causal LM's own projection does no work."""

PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                               "gemma", "olmo2"})
"""transformers model types whose logits are exactly ``lm_head(h)`` (read in transformers 5.19's
``modeling_<type>.py``): these take the chunked path. Others (soft-capping in Gemma 2/3, scaling
in Cohere/Granite/Falcon-H1, trimmed or masked vocabularies, ...) compute their own logits."""


def _causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside DeepSpeed's engine (``.module``) and PEFT's wrapper."""
    inner: Any = getattr(model, "module", model)  # DeepSpeed's engine and PEFT's wrapper: untyped here
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _plain_logits(lm: torch.nn.Module) -> bool:
    config = getattr(lm, "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD_MODELS and \
        "logits_to_keep" in inspect.signature(lm.forward).parameters


def _last_hidden(output) -> torch.Tensor:  # noqa: ANN001 - a transformers ModelOutput or a tuple
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _full_logits_forward(
    model: torch.nn.Module, batch: PackedBatch, ids: torch.Tensor | None, temperature: float, with_entropy: bool,
    entropy_grad: bool,
) -> ResponseLogprobs:
    """``policy_forward_at`` through the model's own ``[B, P + T, V]`` logits."""
    logits = _response_logits(model, batch, temperature)
    logprobs = logprobs_from_logits(logits, batch.response_ids) * batch.mask
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits) * batch.mask
    at_ids = None
    if ids is not None:
        at_ids = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, : logits.shape[1]].long())
        at_ids = at_ids * batch.mask.unsqueeze(-1)
    return ResponseLogprobs(logprobs, entropy, at_ids)


def _response_logits(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """``[B, T, V]`` fp32 logits / T at the response positions, from the model's own projection."""
    out = model(**batch.model_inputs(), use_cache=False)
    return batch.unpacked(out.logits)[:, _response_slice(batch)].float() / temperature


def critic_forward(critic: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, T], last_values [B])``: V(S_{t-1}) per response token and V(S_T).

    ``last_values`` is the value of the state after each row's last valid token; the caller
    uses it as the bootstrap of truncated rows (and 0 for rows that ended with EOS).
    """
    inputs = batch.model_inputs()
    all_values = batch.unpacked(critic(inputs.pop("input_ids"), inputs.pop("attention_mask"), inputs.pop("position_ids"),
                                       **inputs))  # [B, P + T]
    values = all_values[:, _response_slice(batch)] * batch.mask
    last_column = batch.prompt_width - 1 + batch.token_mask.sum(dim=1).long()
    last_values = all_values.gather(1, last_column.unsqueeze(1)).squeeze(1)
    return values, last_values
