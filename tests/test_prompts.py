"""Prompt sources: JSON Lines, Parquet and ``datasets`` folders, string or conversation prompts,
the row's other columns kept, and errors that name file, row and field."""

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayppo.data.prompts import PromptDataError, PromptSampler, PromptSet, load_prompt_set, read_prompt_rows

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7 :"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_jsonl_and_parquet_with_their_other_columns(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :", "answer": "1"}, {"prompt": CHAT, "id": 7}])
    rows = read_prompt_rows(jsonl)
    assert rows.prompts == ["say 1 :", CHAT]
    assert rows.fields == [{"answer": "1"}, {"id": 7}]
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["give 3 :", "give 4 :"], "tests": [["a"], []]}), parquet)
    rows = read_prompt_rows(parquet, column="question")
    assert rows.prompts == ["give 3 :", "give 4 :"]
    assert rows.fields == [{"tests": ["a"]}, {"tests": []}]


def test_missing_file(tmp_path):
    with pytest.raises(PromptDataError, match="prompt file not found"):
        read_prompt_rows(tmp_path / "none.jsonl")


def test_missing_column_names_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"text": "say 2 :"}])
    with pytest.raises(PromptDataError, match=r"row 2: missing field 'prompt'"):
        read_prompt_rows(path)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a"]}), parquet)
    with pytest.raises(PromptDataError, match=r"no column 'prompt' \(columns: text\)"):
        read_prompt_rows(parquet)


def test_empty_prompt_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"prompt": "say 2 :"}, {"prompt": "  "}])
    with pytest.raises(PromptDataError, match=r"p.jsonl: row 3: field 'prompt' is empty"):
        read_prompt_rows(path)


def test_invalid_json_names_the_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "say 1 :"}\n{"prompt": oops}\n')
    with pytest.raises(PromptDataError, match="row 2: not valid JSON"):
        read_prompt_rows(path)


@pytest.mark.parametrize("name, text", [("p.json", '[{"prompt": "say 1 :"}, {"prompt": "say 2 :"}]'),
                                        ("arr.jsonl", '[\n  {"prompt": "say 1 :"}\n]\n')])
def test_a_json_array_file_is_named_as_such_with_a_fix_that_writes_a_new_file(tmp_path, name, text):
    """The suggested command's output is a file that does not exist yet: never the input (a shell
    truncates `> arr.jsonl` before jq reads arr.jsonl), never a file already there."""
    path = tmp_path / name
    path.write_text(text)
    (tmp_path / f"{path.stem}.lines.jsonl").write_text("the user's other file\n")
    with pytest.raises(PromptDataError) as caught:
        read_prompt_rows(path)
    message = str(caught.value)
    assert "expected JSON Lines (one object per line), found a JSON array" in message and "missing field" not in message
    command = re.search(r"convert it with: (.*)$", message).group(1)
    source, target = re.fullmatch(r"jq -c '\.\[\]' (\S+) > (\S+)", command).groups()
    assert source == name and target == f"{path.stem}-2.lines.jsonl"
    assert not (tmp_path / target).exists()


@pytest.mark.parametrize("prompt, says", [
    (12, "row 2: field 'prompt' is empty or not a string (a prompt is a non-empty string or a list of {role, "
         "content} messages; got int)"),
    ({"role": "user", "content": "x"}, "row 2: field 'prompt' is empty or not a string"),
    ([], "row 2: field 'prompt' is an empty conversation"),
    ([{"role": "user", "content": "x"}, "hi"], "row 2: field 'prompt': message 2 must be a {role, content} object, got str"),
    ([{"content": "x"}], "row 2: field 'prompt': message 1 has no 'role'"),
    ([{"role": "system", "content": "x"}, {"role": "user"}], "row 2: field 'prompt': message 2 has no 'content'"),
    ([{"role": "user", "content": 3}], "row 2: field 'prompt': message 1: 'content' must be a string, got int"),
    ([{"role": " ", "content": "x"}], "row 2: field 'prompt': message 1: 'role' is empty"),
])
def test_bad_conversation_rows_name_row_field_and_message(tmp_path, prompt, says):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": CHAT}, {"prompt": prompt}])
    with pytest.raises(PromptDataError) as caught:
        read_prompt_rows(path)
    assert str(caught.value).startswith(f"{path}: {says}")


def test_other_columns_must_be_json(tmp_path):
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["say 1 :", "say 2 :"], "blob": [None, b"\x00\x01"]}), parquet)
    with pytest.raises(PromptDataError, match=r"p.parquet: row 2: column 'blob' is not JSON-serialisable"):
        read_prompt_rows(parquet)
    path = tmp_path / "nan.jsonl"
    path.write_text('{"prompt": "say 1 :", "score": NaN}\n')
    with pytest.raises(PromptDataError, match=r"nan.jsonl: row 1: column 'score' is not JSON-serialisable"):
        read_prompt_rows(path)


def _dataset(rows):
    datasets = pytest.importorskip("datasets")  # test-only: rayppo reads the folders with pyarrow
    return datasets.Dataset.from_list(rows)


ROWS = [{"prompt": CHAT, "answer": "7"}, {"prompt": [{"role": "user", "content": "say 3 :"}], "answer": "3"},
        {"prompt": [{"role": "user", "content": "give 1 :"}], "answer": "1"}]


def test_reads_a_datasets_folder_in_order_across_shards(tmp_path):
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    assert len(list((tmp_path / "ds").glob("data-*.arrow"))) == 2
    rows = read_prompt_rows(tmp_path / "ds", split="ignored for a Dataset folder")
    assert rows.prompts == [r["prompt"] for r in ROWS]
    assert rows.fields == [{"answer": r["answer"]} for r in ROWS]
    assert rows.source == str(tmp_path / "ds")


def test_reads_a_split_of_a_dataset_dict_folder(tmp_path):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": _dataset(ROWS[:2]), "test": _dataset(ROWS[2:])}).save_to_disk(str(folder))
    assert read_prompt_rows(folder).prompts == [ROWS[0]["prompt"], ROWS[1]["prompt"]]  # split "train"
    assert read_prompt_rows(folder, split="test").fields == [{"answer": "1"}]
    with pytest.raises(PromptDataError, match=r"dd: no split 'validation' \(splits: train, test\); set data.split"):
        read_prompt_rows(folder, split="validation")


def test_a_datasets_folder_row_error_names_the_split_folder(tmp_path):
    _dataset([{"prompt": "say 1 :"}, {"prompt": ""}]).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(PromptDataError, match=r"ds: row 2: field 'prompt' is empty"):
        read_prompt_rows(tmp_path / "ds")
    (tmp_path / "plain").mkdir()
    with pytest.raises(PromptDataError, match=r"plain: not a datasets folder \(no state.json or dataset_dict.json"):
        read_prompt_rows(tmp_path / "plain")


def test_datasets_is_not_imported_to_read_its_folders(tmp_path):
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds"))
    code = ("import sys; from rayppo.data.prompts import read_prompt_rows; "
            f"n = len(read_prompt_rows({str(tmp_path / 'ds')!r}).prompts); "
            "print(n, 'datasets' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "False", "False"]


def test_prompt_too_long_names_the_row(tmp_path, tokenizer):
    long_prompt = " ".join(["say"] * 60)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}, {"prompt": long_prompt}])
    with pytest.raises(PromptDataError, match=r"row 2: prompt is 61 tokens, longer than the 52"):
        load_prompt_set(str(path), "prompt", tokenizer, max_tokens=52)


def test_a_prompt_the_tokenizer_encodes_to_nothing_names_file_row_and_tokenizer_class(tmp_path, embedded_dir):
    """A word-level tokenizer saved into a folder whose config.json says qwen2, its tokenizer_config
    naming no class: transformers loads it as Qwen2Tokenizer, which turns every word into nothing
    (the generators would fail deep in vLLM: "The decoder prompt cannot be empty")."""
    from rayppo.models.loading import load_tokenizer

    folder = tmp_path / "qwen2-ish"
    folder.mkdir()
    config = json.loads((embedded_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2",
                                                    "architectures": ["Qwen2ForCausalLM"]}))
    settings = json.loads((embedded_dir / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "tokenizer.json").write_bytes((embedded_dir / "tokenizer.json").read_bytes())
    tokenizer = load_tokenizer(folder)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "say 1 :"}])
    with pytest.raises(PromptDataError, match=rf"p.jsonl: row 1: prompt encodes to no tokens .* with the policy's "
                                              rf"tokenizer {type(tokenizer).__name__} from .*qwen2-ish"):
        load_prompt_set(str(path), "prompt", tokenizer, max_tokens=52)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"  # the case as met, not another failure
    # the same prompts with the tokenizer as saved load
    assert load_prompt_set(str(path), "prompt", load_tokenizer(embedded_dir), max_tokens=52).ids[0]


def test_sampler_covers_every_prompt_each_pass_and_resumes():
    texts = [f"p{i}" for i in range(10)]
    prompts = PromptSet(texts, [[i] for i in range(10)], [None] * 10, [{"i": i} for i in range(10)])
    sampler = PromptSampler(prompts, batch_size=4, seed=3)
    first = sampler.next_batch()
    assert first.fields == [{"i": int(t[1:])} for t in first.texts]  # a row's columns travel with it
    seen = first.texts + sampler.next_batch().texts
    state = sampler.state_dict()
    third = sampler.next_batch().texts
    assert sorted(seen + third[:2]) == sorted(texts)  # one full pass before any repeat
    resumed = PromptSampler(prompts, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch().texts == third
