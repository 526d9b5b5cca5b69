"""Prompt files: JSONL / Parquet, with errors that name file, row and field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayppo.data.prompts import PromptDataError, PromptSampler, load_prompt_set, read_prompt_texts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_jsonl_and_parquet(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"prompt": "say 2 :"}])
    assert read_prompt_texts(jsonl) == ["say 1 :", "say 2 :"]
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["give 3 :", "give 4 :"]}), parquet)
    assert read_prompt_texts(parquet, column="question") == ["give 3 :", "give 4 :"]


def test_missing_file(tmp_path):
    with pytest.raises(PromptDataError, match="prompt file not found"):
        read_prompt_texts(tmp_path / "none.jsonl")


def test_missing_column_names_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"text": "say 2 :"}])
    with pytest.raises(PromptDataError, match=r"row 2: missing field 'prompt'"):
        read_prompt_texts(path)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a"]}), parquet)
    with pytest.raises(PromptDataError, match=r"no column 'prompt' \(columns: text\)"):
        read_prompt_texts(parquet)


def test_empty_prompt_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"prompt": "say 2 :"}, {"prompt": "  "}])
    with pytest.raises(PromptDataError, match=r"p.jsonl: row 3: field 'prompt' is empty"):
        read_prompt_texts(path)


def test_invalid_json_names_the_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "say 1 :"}\n{"prompt": oops}\n')
    with pytest.raises(PromptDataError, match="row 2: not valid JSON"):
        read_prompt_texts(path)


def test_prompt_too_long_names_the_row(tmp_path, tokenizer):
    long_prompt = " ".join(["say"] * 60)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"prompt": long_prompt}])
    with pytest.raises(PromptDataError, match=r"row 2: prompt is 61 tokens, longer than the 52"):
        load_prompt_set(str(path), "prompt", tokenizer, max_tokens=52)


def test_sampler_covers_every_prompt_each_pass_and_resumes():
    texts = [f"p{i}" for i in range(10)]
    sampler = PromptSampler(texts, [[i] for i in range(10)], batch_size=4, seed=3)
    seen = sampler.next_batch().texts + sampler.next_batch().texts
    state = sampler.state_dict()
    third = sampler.next_batch().texts
    assert sorted(seen + third[:2]) == sorted(texts)  # one full pass before any repeat
    resumed = PromptSampler(texts, [[i] for i in range(10)], batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch().texts == third
