"""Chat prompts: conversations rendered by the policy's chat template, carried through the
generator's rollout, and rendered again by a reward model's own template. Real tokenizers and
models (the embedded ones, given a Jinja chat template), no mocks."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from rayppo.actors.generator import GeneratorEngine, SamplingSettings
from rayppo.actors.reward import ModelScorer, RewardEngine
from rayppo.config.load import load_config
from rayppo.data.prompts import PromptBatch, PromptDataError, load_prompt_set
from rayppo.data.rollout import Rollout
from rayppo.models.loading import load_reward_model, load_tokenizer
from rayppo.plan.inputs import check_inputs

POLICY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
REWARD_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}answer is "
                   "{% endif %}{{ m['content'] }} {% endfor %}{{ eos_token }}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7 :"}]


def with_chat_template(source: Path, target: Path, template: str) -> Path:
    """A copy of a model folder whose tokenizer_config.json carries ``template``."""
    shutil.copytree(source, target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def chat_policy_dir(embedded_dir, tmp_path_factory) -> Path:
    return with_chat_template(embedded_dir, tmp_path_factory.mktemp("chat") / "policy", POLICY_TEMPLATE)


@pytest.fixture(scope="module")
def chat_tokenizer(chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    assert tokenizer.chat_template == POLICY_TEMPLATE  # transformers reads it from tokenizer_config.json
    return tokenizer


@pytest.fixture
def chat_file(tmp_path) -> Path:
    rows = [{"prompt": CHAT, "answer": "7"}, {"prompt": "say 3 :", "answer": "3", "tests": [1, 2]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversations_are_rendered_by_the_policy_chat_template(chat_file, chat_tokenizer):
    prompts = load_prompt_set(str(chat_file), "prompt", chat_tokenizer, max_tokens=40)
    rendered = chat_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompts.texts == [rendered, "say 3 :"]
    assert rendered.startswith("<bos><system> be brief <user> say 7 :") and rendered.endswith("<assistant>")
    # The template writes the BOS: tokenised with no special tokens added, so exactly one BOS.
    assert prompts.ids[0] == chat_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert prompts.ids[0].count(chat_tokenizer.bos_token_id) == 1
    assert prompts.ids[1] == chat_tokenizer("say 3 :")["input_ids"]  # a string prompt: as before
    assert prompts.messages == [CHAT, None]
    assert prompts.fields == [{"answer": "7"}, {"answer": "3", "tests": [1, 2]}]
    assert prompts.messages_json() == [json.dumps(CHAT), ""]
    assert [json.loads(f) for f in prompts.fields_json()] == prompts.fields


def test_a_conversation_needs_a_chat_template(chat_file, tokenizer):
    assert not tokenizer.chat_template  # the embedded tokenizer has none
    with pytest.raises(PromptDataError, match=r"chat.jsonl: row 1: field 'prompt' is a chat conversation, but the "
                                              r"policy tokenizer has no chat template"):
        load_prompt_set(str(chat_file), "prompt", tokenizer, max_tokens=40)


def test_an_overlong_conversation_names_its_row(tmp_path, chat_tokenizer):
    path = tmp_path / "p.jsonl"
    long_chat = [{"role": "user", "content": " ".join(["say"] * 30)}]
    path.write_text(json.dumps({"prompt": "say 1 :"}) + "\n" + json.dumps({"prompt": long_chat}) + "\n")
    with pytest.raises(PromptDataError, match=r"p.jsonl: row 2: prompt is 33 tokens, longer than the 20"):
        load_prompt_set(str(path), "prompt", chat_tokenizer, max_tokens=20)


def test_the_check_before_loading_knows_conversations_and_datasets_folders(chat_file, embedded_dir, chat_policy_dir,
                                                                            tmp_path):
    with pytest.raises(PromptDataError, match=r"chat.jsonl: row 1: .* policy tokenizer has no chat template"):
        check_inputs(load_config(None, [f"data.prompts={chat_file}", f"model.policy={embedded_dir}"]))
    check_inputs(load_config(None, [f"data.prompts={chat_file}", f"model.policy={chat_policy_dir}"]))
    datasets = pytest.importorskip("datasets")
    long_chat = [{"role": "user", "content": "say 1 :"}, {"role": "user", "content": " ".join(["7"] * 60)}]
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": CHAT}]),
                          "test": datasets.Dataset.from_list([{"prompt": CHAT}, {"prompt": long_chat}])}
                         ).save_to_disk(str(folder))
    policy = [f"model.policy={chat_policy_dir}", "generators.max_model_len=64", "rollout.max_new_tokens=8"]
    check_inputs(load_config(None, [f"data.prompts={folder}", *policy]))  # the train split fits
    with pytest.raises(PromptDataError, match=rf"{folder / 'test'}: row 2: prompt is at least \d+ tokens"):
        check_inputs(load_config(None, [f"data.prompts={folder}", "data.split=test", *policy]))
    with pytest.raises(PromptDataError, match=r"no split 'dev' \(splits: train, test\)"):
        check_inputs(load_config(None, [f"eval.prompts={folder}", "eval.split=dev", *policy]))


def test_the_generator_copies_each_row_into_the_rollout(chat_file, chat_policy_dir, chat_tokenizer):
    prompts = load_prompt_set(str(chat_file), "prompt", chat_tokenizer, max_tokens=40)
    engine = GeneratorEngine(str(chat_policy_dir), SamplingSettings(max_new_tokens=3, temperature=1.0), backend="hf")
    rollout = engine.generate(prompts.select([1, 0]), seed=0)
    assert rollout.prompt_text == [prompts.texts[1], prompts.texts[0]]
    assert rollout.prompt_ids == [prompts.ids[1], prompts.ids[0]]
    assert rollout.conversations() == [None, CHAT]
    assert rollout.row_fields() == [{"answer": "3", "tests": [1, 2]}, {"answer": "7"}]
    for copy in (Rollout.from_arrow(rollout.to_arrow()), pickle.loads(pickle.dumps(rollout)),
                 Rollout.concat([rollout.select([0]), rollout.select([1])])):
        assert copy.prompt_messages == rollout.prompt_messages == ["", json.dumps(CHAT)]
        assert copy.prompt_fields == rollout.prompt_fields


def test_rollouts_without_the_prompt_columns_still_round_trip(tmp_path):
    plain = Rollout([[1]], [[2]], [[0.0]], ["stop"], ["say 1 :"], ["1"])
    back = Rollout.from_arrow(plain.to_arrow())
    assert back.prompt_messages == [] and back.prompt_fields == []
    assert back.conversations() == [None] and back.row_fields() == [{}]
    plain.prompt_fields = ['{"answer": "1"}']
    plain.write_parquet(tmp_path / "r.parquet")
    import pyarrow.parquet as pq

    assert Rollout.from_arrow(pq.read_table(tmp_path / "r.parquet")).row_fields() == [{"answer": "1"}]


@pytest.fixture(scope="module")
def chat_reward_dir(reward_model_dir, tmp_path_factory) -> Path:
    return with_chat_template(reward_model_dir, tmp_path_factory.mktemp("chat_rm") / "rm", REWARD_TEMPLATE)


def _rollout(batch: PromptBatch, responses: list[str]) -> Rollout:
    n = len(batch)
    return Rollout(batch.ids, [[1]] * n, [[0.0]] * n, ["stop"] * n, batch.texts, responses,
                   prompt_messages=batch.messages_json(), prompt_fields=batch.fields_json())


def test_a_reward_model_scores_the_text_of_its_own_chat_template(chat_reward_dir, chat_file, chat_tokenizer):
    prompts = load_prompt_set(str(chat_file), "prompt", chat_tokenizer, max_tokens=40)
    scores = RewardEngine(ModelScorer(str(chat_reward_dir), batch_size=1)).scores(_rollout(prompts, ["7 7", "3"]))
    tokenizer, model = load_tokenizer(chat_reward_dir), load_reward_model(chat_reward_dir).eval()
    assert tokenizer.chat_template == REWARD_TEMPLATE
    conversations = [CHAT + [{"role": "assistant", "content": "7 7"}],
                     [{"role": "user", "content": "say 3 :"}, {"role": "assistant", "content": "3"}]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    assert texts[1] == "<bos>say 3 : answer is 3 <eos>"

    def score(text: str, special: bool) -> float:
        with torch.no_grad():
            return model(**tokenizer(text, return_tensors="pt", add_special_tokens=special)).logits[0, 0].item()

    # The engine runs one packed row (attention per sequence), the check each text padded alone: the
    # same fp32 terms summed in another order, ~1e-7 on a 2-layer 64-wide model's score of ~0.1.
    assert scores == [pytest.approx(score(texts[0], False), abs=1e-5), pytest.approx(score(texts[1], False), abs=1e-5)]
    assert scores[1] != pytest.approx(score("say 3 : 3", True), abs=1e-5)  # not the plain text the model had no template for
