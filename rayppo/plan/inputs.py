"""The job's inputs checked before anything heavy loads: model folders, the prompt files (training
and evaluation), the reward function. ``rayppo train`` runs ``check_inputs`` right after the
config, before torch, transformers, Ray, vLLM or DeepSpeed are imported, so a typo'd path or a
broken file is answered in well under two seconds, in one line naming the field, the file and
the row.

Only what can be checked exactly is checked here; the loaders still check everything again
(``rayppo.models.loading``, ``rayppo.data.prompts``) for the callers that skip this module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rayppo.config.schema import Config, ConfigError
from rayppo.data.prompts import EMBEDDED_PROMPTS, PromptDataError, PromptRows, embedded_rows, read_prompt_rows
from rayppo.errors import ModelFolderError
from rayppo.models.paths import built_on_first_use, embedded_path, is_gguf, saved_policy
from rayppo.models.shape import context_of
from rayppo.plan.model_files import check_reward_model, check_tokenizer_files, check_weight_files, safetensors_tensors
from rayppo.plan.reward_check import check_environment, check_reward_function

log = logging.getLogger(__name__)


def check_inputs(cfg: Config) -> None:
    """Raise the first problem found, as a ``RayppoError`` whose message names it."""
    configs, policy_dir = _check_models(cfg)
    train_rows = _check_prompt_files(cfg, configs, policy_dir)
    _check_user_code(cfg, train_rows or embedded_rows(cfg.data.prompts, cfg.data.prompt_column))


def _check_models(cfg: Config) -> tuple[dict[str, dict[str, Any]], Path]:
    """The model folders (and GGUF files), their tokenizers against the policy's, and the policy
    against the task and the generators; returns each folder's ``config.json`` and the policy's folder."""
    m = cfg.model
    folders = {"model.policy": m.policy, "model.reference": m.reference, "model.critic": m.critic,
               "reward.model": cfg.reward.model,
               "distill.teacher": str(saved_policy(cfg.distill.teacher)) if cfg.distill.teacher else None}
    for name, path in folders.items():
        if path is not None and is_gguf(path) and not Path(path).expanduser().is_file():
            raise ModelFolderError(f"{name}: GGUF file {path} does not exist")
    configs = {name: check_model_folder(name, path) for name, path in folders.items()
               if path is not None and not built_on_first_use(path)}
    policy_dir = embedded_path(m.cache_dir, m.policy) if built_on_first_use(m.policy) else Path(m.policy)
    for name in ("model.reference", "model.critic", "distill.teacher"):  # they read the policy's token ids
        folder = folders[name]
        if folder is not None and not built_on_first_use(folder):
            check_same_tokenizer(name, Path(folder), policy_dir)
    if cfg.data.prompts == "embedded" and m.policy != "embedded":
        check_model_meets_embedded_task(cfg, policy_dir)
    if (policy_dir / "config.json").is_file():  # the embedded model is built later: a Llama, no experts
        check_policy_for_generators(cfg, policy_dir)
    return configs, policy_dir


def _check_prompt_files(cfg: Config, configs: dict[str, dict[str, Any]], policy_dir: Path) -> PromptRows | None:
    """The training and evaluation prompt files: their rows, chat templates and lengths; returns the
    first file's rows (the ones the reward function is tried on), None when both are built in."""
    train_rows = None
    for spec, split in ((cfg.data.prompts, cfg.data.split), (cfg.eval.prompts, cfg.eval.split)):
        if spec is None or spec in EMBEDDED_PROMPTS:
            continue
        rows = read_prompt_rows(spec, cfg.data.prompt_column, split)
        train_rows = train_rows or rows  # the rows the reward function is tried on
        check_chat_template(rows, policy_dir)
        policy_config = configs.get("model.policy") or _read_config("model.policy", policy_dir, must_exist=False)
        positions = cfg.generators.max_model_len or (context_of(policy_config) if policy_config else None)
        if positions:
            check_prompt_lengths(rows, policy_dir, positions - cfg.rollout.max_new_tokens)
        if spec == cfg.data.prompts and len(rows.prompts) < cfg.rollout.batch_size:
            log.warning("%s holds %d prompts, fewer than rollout.batch_size=%d: each iteration repeats some of them "
                        "(lower rollout.batch_size to sample each prompt at most once per iteration)",
                        rows.source, len(rows.prompts), cfg.rollout.batch_size)
    return train_rows


def _check_user_code(cfg: Config, rows: PromptRows) -> None:
    """The reward and gold functions and the environment, each tried on ``rows``."""
    for function in (cfg.reward.function, cfg.reward.gold_function):
        if function is not None:
            check_reward_function(function, rows, cfg.reward.timeout_s)
    if cfg.rollout.environment is not None:
        check_environment(cfg.rollout.environment, rows, cfg.rollout.environment_timeout_s)


def check_policy_for_generators(cfg: Config, policy_dir: Path) -> None:
    """What the generators cannot do with this policy, said before anything starts: a
    ``checks.sync_fault_tensor`` the policy does not have (the fault would hit nothing, and a
    test of the guard would pass for the wrong reason)."""
    if cfg.checks.sync_fault == "none":
        return
    names = {name for file in sorted(policy_dir.glob("*.safetensors")) for name in safetensors_tensors("model.policy", file)}
    if names and cfg.checks.sync_fault_tensor not in names:
        near = sorted(n for n in names if n.endswith(cfg.checks.sync_fault_tensor.rsplit(".", 2)[-2] + ".weight"))
        raise ConfigError(f"checks.sync_fault_tensor: {policy_dir} has no tensor {cfg.checks.sync_fault_tensor!r}"
                          + (f" (it has e.g. {near[0]!r})" if near else ""))


def check_model_meets_embedded_task(cfg: Config, policy_dir: Path) -> None:
    """A user's own model with the default data (the embedded "say a digit" task, a toy made for
    the embedded model): refused when its tokenizer cannot even write the task's prompts (they
    would train at reward 0 without a word), else a warning that this is probably not meant."""
    file = policy_dir / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        from rayppo.tasks import digits

        tokenizer = Tokenizer.from_file(str(file))
        unknown = tokenizer.token_to_id(tokenizer.model.unk_token) if hasattr(tokenizer.model, "unk_token") else None
        prompt = digits.prompts(1)[0]
        if unknown is not None and unknown in tokenizer.encode(prompt, add_special_tokens=False).ids:
            raise ConfigError(f"data.prompts: embedded (the built-in digit task) does not suit model.policy="
                              f"{cfg.model.policy}: its tokenizer turns {prompt!r} into unknown tokens; give your own "
                              "data.prompts and reward (reward.function, reward.model or reward.url)")
    log.warning("model.policy is your model but data.prompts is the embedded digit task (made for the embedded model): "
                "set data.prompts and a reward for your task")


def check_model_folder(field: str, folder: str | Path) -> dict[str, Any]:
    """A local Hugging Face model folder with safetensors weights; returns its ``config.json``."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelFolderError(f"{field}: {path}: folder not found (rayppo downloads no model but the "
                               "built-in smollm2-135m-instruct: give a local Hugging Face model folder)")
    config = _read_config(field, path)
    assert config is not None  # must_exist: _read_config raised rather than return None
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f" (found {', '.join(pickled[:3])}: pickle, which can run code when loaded)" if pickled else ""
        raise ModelFolderError(f"{field}: {path} has no .safetensors weights{found}; rayppo loads safetensors only "
                               "(convert with transformers: from_pretrained(...).save_pretrained(dir))")
    check_weight_files(field, path, config)
    if field in ("model.policy", "reward.model"):  # the folders whose own tokenizer is loaded
        check_tokenizer_files(field, path)
    if field == "reward.model":
        check_reward_model(path, config)
    return config


def _read_config(field: str, path: Path, must_exist: bool = True) -> dict[str, Any] | None:
    file = path / "config.json"
    if not file.is_file():
        if not must_exist:
            return None
        raise ModelFolderError(f"{field}: {path} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{field}: {file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFolderError(f"{field}: {file} has no model_type: not a transformers model config")
    return config


def check_same_tokenizer(field: str, folder: Path, policy_dir: Path) -> None:
    """``folder``'s vocabulary must be the policy's: it scores the policy's token ids. Compared
    when both folders carry a ``tokenizer.json`` (vocabulary and added tokens, id by id)."""
    mine, theirs = _vocabulary(folder), _vocabulary(policy_dir)
    if mine is not None and theirs is not None and mine != theirs:
        differ = sorted(set(mine[0].items()) ^ set(theirs[0].items()))[:1]
        example = f" (e.g. {differ[0][0]!r} -> {differ[0][1]})" if differ else " (added tokens)"
        if field == "distill.teacher":  # the trainers' fuller check (models/teacher.py) says it the same way
            raise ModelFolderError(f"distill.teacher: the teacher's tokenizer differs from the policy's: vocabulary "
                                   f"of {len(mine[0])} tokens against {len(theirs[0])}{example}; it would score the "
                                   "student's token ids as other words")
        raise ModelFolderError(f"{field}: {folder}'s tokenizer differs from model.policy's{example}: it would "
                               "read the policy's token ids as other words")


def _vocabulary(folder: Path) -> tuple[dict[str, int], list[tuple[str, int]]] | None:
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        added = sorted((t["content"], t["id"]) for t in data.get("added_tokens", []))
    except (ValueError, KeyError, TypeError):
        return None  # a format this check does not know: the loaders will tell
    return (dict(vocab) if isinstance(vocab, dict) else {str(i): i for i, _ in enumerate(vocab)}), added


def check_chat_template(rows: PromptRows, policy_dir: Path) -> None:
    """Conversation rows need the policy tokenizer's chat template. Refused only when the policy
    folder has a tokenizer config and no template in any place transformers reads one from."""
    chat = next((row for row, p in enumerate(rows.prompts, start=1) if not isinstance(p, str)), None)
    config_file = policy_dir / "tokenizer_config.json"
    if chat is None or not config_file.is_file():
        return
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return  # the tokenizer loader will say what is wrong with it
    files = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
    if (isinstance(config, dict) and config.get("chat_template")) or any((policy_dir / f).exists() for f in files):
        return
    raise PromptDataError(f"{rows.source}: row {chat}: field {rows.column!r} is a chat conversation, but the policy "
                          "tokenizer has no chat template (add chat_template to its tokenizer_config.json, or give "
                          "plain string prompts)")


def check_prompt_lengths(rows: PromptRows, policy_dir: Path, max_tokens: int) -> None:
    """A prompt whose tokens *without* special tokens already exceed ``max_tokens`` is refused
    (a lower bound of the exact count, so nothing valid is refused; the exact check, with the
    special tokens transformers adds, runs when the tokenizer loads). A conversation's bound is
    the sum of its messages' contents (its chat template only adds to them), less one token at
    each edge of a content, where a subword merge with the template's text may save one."""
    counts = content_tokens(rows, policy_dir)
    if counts is None:
        return
    for row, (count, prompt) in enumerate(zip(counts, rows.prompts), start=1):
        bound = count - (0 if isinstance(prompt, str) else 2 * len(prompt))
        if bound > max_tokens:
            raise PromptDataError(f"{rows.source}: row {row}: prompt is at least {bound} tokens, longer than "
                                  f"the {max_tokens} the model allows with rollout.max_new_tokens reserved")


TEMPLATE_TOKENS_PER_MESSAGE = 8
"""What a chat template adds per message, for planning (ChatML: ``<|im_start|>role⏎ … <|im_end|>⏎``,
5 tokens; Llama 3's header and end-of-turn tokens, 5; a margin for system preambles)."""


def longest_prompt_tokens(rows: PromptRows, policy_dir: Path) -> int | None:
    """The longest prompt of ``rows`` in the policy's tokens, for planning (``rayppo plan``): a plain
    prompt's tokens and a BOS, a conversation's contents and ``TEMPLATE_TOKENS_PER_MESSAGE`` per
    message (and its generation prompt). None without the policy's ``tokenizer.json``."""
    counts = content_tokens(rows, policy_dir)
    if counts is None:
        return None
    return max(count + (1 if isinstance(prompt, str) else TEMPLATE_TOKENS_PER_MESSAGE * (len(prompt) + 1))
               for count, prompt in zip(counts, rows.prompts))


def content_tokens(rows: PromptRows, policy_dir: Path) -> list[int] | None:
    """[N] tokens of each prompt's text (a conversation's: its messages' contents, summed), without
    special tokens, by the policy's ``tokenizer.json``; None when the folder has none."""
    file = policy_dir / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer  # Rust, no torch: a fraction of a second

    pieces, owner = [], []  # every text to count, and the row it belongs to
    for row, prompt in enumerate(rows.prompts):
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        pieces.extend(texts)
        owner.extend([row] * len(texts))
    counts = [0] * len(rows.prompts)
    for row, encoding in zip(owner, Tokenizer.from_file(str(file)).encode_batch(pieces, add_special_tokens=False)):
        counts[row] += len(encoding.ids)
    return counts
