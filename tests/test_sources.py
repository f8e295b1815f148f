"""Prompt sources: formats, validation errors, slicing, shuffling, epochs and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.sources import DataError, Exhausted, PromptSource, split_path
from tests.tiny_tokenizer import build_chatml_tokenizer

CALC_TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny ChatML tokenizer, built once for this module."""
    return build_chatml_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """One row per line; a ``str`` row is written verbatim (blank or malformed lines)."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def numbered_rows(n: int) -> list[dict[str, Any]]:
    """``n`` simple rows whose prompt and label say their row number."""
    return [{"prompt": f"question {i}", "label": str(i)} for i in range(n)]


def open_source(path: Path | str, tokenizer: Any = None, **config: Any) -> PromptSource:
    """Open ``path`` with the given config fields."""
    return PromptSource.open(PromptSource.Config(path=str(path), **config), tokenizer)


def draw_uids(source: PromptSource, n: int = 10_000) -> list[str]:
    """Uids of up to ``n`` more draws."""
    return [p.uid for p in source.take(n)]


# -- formats and fields ----------------------------------------------------------------
def test_jsonl_string_prompts_carry_labels_metadata_and_ids(tmp_path: Path) -> None:
    rows = [
        {"prompt": "What is 2+2?", "label": "4", "metadata": {"level": 1}},
        "",
        {"prompt": "What is 3+3?", "label": 6},
    ]
    source = open_source(write_jsonl(tmp_path / "train.jsonl", rows), shuffle=False)
    first, second = source.take(2)
    assert (source.num_rows, source.name) == (2, "train")
    assert (first.uid, first.prompt_id, first.epoch) == ("train:0@0", "train:0", 0)
    assert (first.prompt, first.label, first.metadata) == ("What is 2+2?", "4", {"level": 1})
    assert (second.prompt_id, second.label, second.metadata) == ("train:1", 6, {})
    assert (first.text, first.packed_prompt, first.tools) == (None, b"", None)


def test_a_json_array_and_a_saved_hf_dataset_give_the_same_prompts_as_jsonl(
    tmp_path: Path, tokenizer: Any
) -> None:
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"question {i}"}], "label": str(i),
             "metadata": {"level": i % 3}} for i in range(6)]  # fmt: skip
    jsonl = write_jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    config = {"apply_chat_template": True, "num_epochs": 2, "seed": 5, "name": "data"}
    want = open_source(f"{jsonl}@[1:]", tokenizer, **config).take(100)
    assert open_source(f"{tmp_path / 'array.json'}@[1:]", tokenizer, **config).take(100) == want
    assert open_source(f"{tmp_path / 'hf'}@[1:]", tokenizer, **config).take(100) == want
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"splits \['train'\]: name one"):
        open_source(tmp_path / "dict")
    (tmp_path / "bad.json").write_text('[{"prompt": "a"},')
    with pytest.raises(DataError, match=r"bad\.json: not valid JSON"):
        open_source(tmp_path / "bad.json")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a saved datasets dataset"):
        open_source(tmp_path / "plain")


def test_prompts_longer_than_max_prompt_length_are_dropped_at_load_and_counted(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [{"prompt": "x" * n, "label": str(n)} for n in (3, 40, 5, 80)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    lengths = [n for _, n in open_source(path, tokenizer).prompt_lengths()]
    limit = sorted(lengths)[1]
    source = open_source(path, tokenizer, max_prompt_length=limit, shuffle=False)
    assert source.too_long == 2 and source.num_rows == 2
    assert [p.label for p in source.take(10)] == ["3", "5"]
    with pytest.raises(DataError, match="every one of the 4 prompts is longer"):
        open_source(path, tokenizer, max_prompt_length=1)
    with pytest.raises(DataError, match="no tokenizer"):
        open_source(path, max_prompt_length=10)
    state = source.state_dict()
    other = open_source(path, tokenizer, max_prompt_length=lengths[3])
    with pytest.raises(DataError, match="max_prompt_length"):
        other.load_state_dict(state)


def test_chat_template_kwargs_reach_the_template(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "label": "x"}])
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.chat_template, old = template, tokenizer.chat_template
    try:
        source = open_source(path, tokenizer, apply_chat_template=True,
                             chat_template_kwargs={"greeting": "hello "})  # fmt: skip
        assert source.take(1)[0].text == "hello hi"
    finally:
        tokenizer.chat_template = old


def test_a_configured_name_prefixes_prompt_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(2))
    assert open_source(path, name="gsm8k", shuffle=False).next().uid == "gsm8k:0@0"


def test_chat_prompts_are_rendered_with_the_template_and_tokenized(
    tmp_path: Path, tokenizer: Any
) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü 🙂"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "label": "x"}])
    prompt = open_source(path, tokenizer, apply_chat_template=True).next()
    assert prompt.prompt == chat
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt.text
    assert "<|im_start|>user\nHi ü 🙂<|im_end|>" in prompt.text
    assert prompt.text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(prompt.prompt_tokens.tolist()) == prompt.text


def test_a_templated_string_prompt_gets_the_system_prompt(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(1))
    config = {"apply_chat_template": True, "system_prompt": "Think step by step."}
    text = open_source(path, tokenizer, **config).next().text
    assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>\n")
    assert "<|im_start|>user\nquestion 0<|im_end|>" in text


def test_without_a_template_the_string_prompt_is_the_text(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(1))
    prompt = open_source(path, tokenizer).next()
    assert prompt.text == "question 0"
    assert prompt.prompt_tokens.tolist() == tokenizer("question 0")["input_ids"]


def test_chat_prompts_without_a_template_are_refused_with_a_tokenizer(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [*numbered_rows(2), {"prompt": [{"role": "user", "content": "hi"}], "label": "1"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"train\.jsonl:3: .*set apply_chat_template"):
        open_source(path, tokenizer)
    assert open_source(path).num_rows == 3  # without a tokenizer the workflow renders chats


@pytest.mark.parametrize("as_json_string", [False, True])
def test_the_tools_column_reaches_the_template(
    tmp_path: Path, tokenizer: Any, as_json_string: bool
) -> None:
    tools = json.dumps([CALC_TOOL]) if as_json_string else [CALC_TOOL]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"prompt": "2*3?", "tools": tools}])
    config = {"tools_key": "tools", "label_key": None, "apply_chat_template": True}
    prompt = open_source(path, tokenizer, **config).next()
    assert prompt.tools == [CALC_TOOL]
    assert '<|im_start|>system\n# Tools\n{"type": "function"' in prompt.text
    assert '"name": "calculator"' in prompt.text


def test_parquet_gives_the_same_prompts_as_the_same_jsonl(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "label": str(i),
            "metadata": {"level": i % 3},
        }
        for i in range(6)
    ]
    jsonl = write_jsonl(tmp_path / "data.jsonl", rows)
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    config = {"apply_chat_template": True, "num_epochs": 2, "seed": 5}
    from_jsonl = open_source(f"{jsonl}@[1:]", tokenizer, **config).take(100)
    from_parquet = open_source(f"{parquet}@[1:]", tokenizer, **config).take(100)
    assert len(from_jsonl) == 10
    assert from_parquet == from_jsonl


def test_a_consumer_editing_a_prompt_does_not_edit_the_source(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "metadata": {"k": 1}}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    source = open_source(path, label_key=None, num_epochs=2)
    first = source.next()
    first.prompt.append({"role": "assistant", "content": "hello"})
    first.metadata["k"] = 2
    second = source.next()
    assert (len(second.prompt), second.metadata) == (1, {"k": 1})


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "config", "problem"),
    [
        ('{"prompt": "x",', {}, "invalid JSON: Expecting property name"),
        ('["x"]', {}, "row is an array, expected an object"),
        ('{"promt": "x"}', {}, "missing key 'prompt' (did you mean 'promt'?)"),
        ('{"text": "x"}', {}, "missing key 'prompt' (row has keys: 'text')"),
        ('{"prompt": 3}', {}, "'prompt' is a number, expected a string or a list of chat"),
        ('{"prompt": []}', {}, "'prompt' is an empty list of chat messages"),
        ('{"prompt": ["hi"]}', {}, "message 0 of 'prompt' is a string, expected an object"),
        ('{"prompt": [{"role": "bot", "content": "x"}]}', {}, "message 0 of 'prompt' has role"),
        ('{"prompt": [{"role": "user"}]}', {}, "has content null, expected a string"),
        ('{"prompt": "x", "metadata": [1]}', {}, "metadata 'metadata' is an array, expected"),
        ('{"prompt": "x", "tools": {"a": 1}}', {"tools_key": "tools"}, "must be a list of obj"),
        ('{"prompt": "x", "tools": ["f"]}', {"tools_key": "tools"}, "must be a list of objects"),
        ('{"prompt": "x", "tools": "[oops"}', {"tools_key": "tools"}, "a string but not JSON"),
    ],
)
def test_a_malformed_row_names_file_line_and_problem(
    tmp_path: Path, line: str, config: dict[str, Any], problem: str
) -> None:
    # The bad row is on line 3, after a blank line that still counts.
    good = json.dumps({"prompt": "fine", "label": "1", "tools": [CALC_TOOL]})
    path = write_jsonl(tmp_path / "train.jsonl", [good, "", line])
    with pytest.raises(DataError) as caught:
        open_source(path, **config)
    assert f"{path}:3: " in str(caught.value)
    assert problem in str(caught.value)


def test_a_malformed_parquet_row_is_named_by_row_number(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), path)
    with pytest.raises(DataError, match=r"train\.parquet row 2: 'prompt' is null"):
        open_source(path, label_key=None)


def test_a_label_key_that_no_row_has_is_an_error_with_a_hint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(DataError, match=r"no row has label_key 'label'.*set label_key to null"):
        open_source(path)
    with pytest.raises(DataError, match=r"no row has label_key 'answr' \(did you mean 'answer'"):
        open_source(path, label_key="answr")
    assert open_source(path, label_key="answer").next().label == "1"


def test_a_chat_template_failure_names_the_row(tmp_path: Path) -> None:
    tokenizer = build_chatml_tokenizer(tmp_path / "tokenizer")
    tokenizer.chat_template = "{{ raise_exception('no tools, please') if tools }}{{ 'ok' }}"
    rows = [{"prompt": "a"}, {"prompt": "b", "tools": [CALC_TOOL]}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    config = {"apply_chat_template": True, "shuffle": False, "tools_key": "tools"}
    source = open_source(path, tokenizer, label_key=None, **config)
    assert source.next().text == "ok"
    with pytest.raises(DataError, match=r"train\.jsonl:2: chat template failed: no tools"):
        source.next()
    with pytest.raises(DataError, match=r"train\.jsonl:2: chat template failed"):
        open_source(f"{path}@[1:]", tokenizer, label_key=None, **config)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        open_source(tmp_path / "nope.jsonl")


def test_an_unknown_extension_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"unknown format '\.csv', expected one of \.jsonl"):
        open_source(path)


def test_a_file_of_blank_lines_has_no_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"train\.jsonl has no rows"):
        open_source(path)


def test_an_empty_slice_says_how_many_rows_there_are(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(4))
    with pytest.raises(DataError, match=r"slice \[3:1\] selects no rows of 4"):
        open_source(f"{path}@[3:1]")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("a.jsonl@[x:2]", "slice bound 'x' is not an integer"),
        ("a.jsonl@[1:2:3]", "must be [start:stop], no step"),
        ("a.jsonl@[3]", "must be [start:stop], no step"),
        ("a.jsonl@[1:2", "malformed row slice"),
        ("@[1:2]", "no file before the row slice"),
    ],
)
def test_a_bad_slice_is_a_config_error_naming_the_path(spec: str, problem: str) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        PromptSource.Config(path=spec)
    assert f"path {spec!r}" in str(caught.value)
    assert problem in str(caught.value)


def test_unknown_config_keys_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="extra_forbidden"):
        PromptSource.Config(path="a.jsonl", inputkey="q")


# -- slicing, shuffling, epochs --------------------------------------------------------
@pytest.mark.parametrize(
    ("suffix", "rows"),
    [("@[2:5]", [2, 3, 4]), ("@[:3]", [0, 1, 2]), ("@[-2:]", [8, 9]), ("", list(range(10)))],
)
def test_a_slice_selects_rows_and_keeps_their_file_row_numbers(
    tmp_path: Path, suffix: str, rows: list[int]
) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(10))
    source = open_source(f"{path}{suffix}", shuffle=False)
    prompts = source.take(100)
    assert source.num_rows == len(rows)
    assert [p.prompt_id for p in prompts] == [f"train:{i}" for i in rows]
    assert [p.label for p in prompts] == [str(i) for i in rows]


def test_split_path_reads_slices_like_python() -> None:
    assert split_path("d/a.jsonl") == ("d/a.jsonl", slice(None))
    assert split_path("d/a.jsonl@[ -3 : ]") == ("d/a.jsonl", slice(-3, None))


def test_a_seeded_shuffle_is_reproducible_and_new_each_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(20))
    first = draw_uids(open_source(path, seed=3, num_epochs=3))
    assert first == draw_uids(open_source(path, seed=3, num_epochs=3))
    assert first != draw_uids(open_source(path, seed=4, num_epochs=3))
    epochs = [[u.split("@")[0] for u in first[i : i + 20]] for i in (0, 20, 40)]
    assert all(sorted(e) == sorted(f"train:{i}" for i in range(20)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_without_shuffle_every_epoch_is_in_file_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(3))
    uids = draw_uids(open_source(path, shuffle=False, num_epochs=2))
    assert uids == [f"train:{i}@{e}" for e in (0, 1) for i in range(3)]


def test_num_rollouts_continues_across_epochs_and_then_stops(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(4))
    source = open_source(path, num_epochs=1, num_rollouts=10)
    prompts = source.take(7) + source.take(7)
    assert [p.epoch for p in prompts] == [0] * 4 + [1] * 4 + [2] * 2
    assert len({p.uid for p in prompts}) == 10
    assert (source.exhausted, source.drawn, source.take(3)) == (True, 10, [])
    with pytest.raises(Exhausted):
        source.next()


def test_num_epochs_stops_after_the_last_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(3))
    source = open_source(path, num_epochs=2)
    assert len(source.take(4)) == 4
    assert (source.epoch, source.exhausted) == (1, False)
    assert len(source.take(4)) == 2
    assert (source.epoch, source.exhausted) == (2, True)
    with pytest.raises(ValueError, match="n >= 0"):
        source.take(-1)


# -- checkpoint and resume --------------------------------------------------------------
def resumed(source: PromptSource, config: PromptSource.Config) -> PromptSource:
    """A fresh source of ``config`` restored from ``source``'s state via JSON."""
    fresh = PromptSource.open(config)
    fresh.load_state_dict(json.loads(json.dumps(source.state_dict())))
    return fresh


@pytest.mark.parametrize("stop", [0, 3, 5, 7, 10, 12])
def test_resume_continues_exactly_like_an_uninterrupted_source(tmp_path: Path, stop: int) -> None:
    # 5 rows, 3 epochs: stops mid-epoch, on epoch boundaries and after the end.
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(5))
    config = PromptSource.Config(path=str(path), seed=11, num_epochs=3)
    expected = draw_uids(PromptSource.open(config))
    source = PromptSource.open(config)
    head = draw_uids(source, stop)
    assert head + draw_uids(resumed(source, config)) == expected


def test_the_state_is_small_plain_json(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(5))
    source = open_source(f"{path}@[1:]", num_epochs=3)
    source.take(6)
    state = source.state_dict()
    assert (state["epoch"], state["cursor"], state["drawn"]) == (1, 2, 6)
    assert state["source"]["num_rows"] == 4
    assert state["source"]["rows"] == [1, 5]
    assert len(state["source"]["sha256"]) == 64
    assert json.loads(json.dumps(state)) == state


def test_a_changed_file_refuses_the_old_state(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(5))
    source = open_source(path)
    source.take(2)
    state = source.state_dict()
    write_jsonl(path, [*numbered_rows(4), {"prompt": "changed", "label": "4"}])
    with pytest.raises(DataError, match=r"saved for other data.*changed: sha256"):
        open_source(path).load_state_dict(state)
    write_jsonl(path, numbered_rows(6))
    with pytest.raises(DataError, match="num_rows 5 -> 6"):
        open_source(path).load_state_dict(state)


def test_a_state_for_another_seed_or_slice_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(6))
    state = open_source(f"{path}@[:3]").state_dict()
    with pytest.raises(DataError, match=r"seed 0 -> 1.*pass --rollout-seed 0"):
        open_source(f"{path}@[:3]", seed=1).load_state_dict(state)
    with pytest.raises(DataError, match=r"rows \[0, 3\] -> \[3, 6\]"):
        open_source(f"{path}@[3:]").load_state_dict(state)


def test_a_malformed_state_is_refused(tmp_path: Path) -> None:
    source = open_source(write_jsonl(tmp_path / "train.jsonl", numbered_rows(3)))
    state = source.state_dict()
    with pytest.raises(DataError, match="bad cursor"):
        source.load_state_dict({**state, "cursor": 4})
    with pytest.raises(DataError, match="disagrees"):
        source.load_state_dict({**state, "drawn": 2})
    with pytest.raises(DataError, match="not a version 1 source state"):
        source.load_state_dict({})


@settings(max_examples=80, deadline=None)
@given(
    num_rows=st.integers(1, 9),
    start=st.none() | st.integers(-10, 10),
    stop=st.none() | st.integers(-10, 10),
    seed=st.integers(0, 3),
    shuffle=st.booleans(),
    num_epochs=st.integers(1, 3),
    num_rollouts=st.none() | st.integers(1, 25),
    split=st.integers(0, 30),
)
def test_draw_all_equals_draw_some_then_resume_and_draw_the_rest(
    tmp_path_factory: pytest.TempPathFactory,
    num_rows: int,
    start: int | None,
    stop: int | None,
    seed: int,
    shuffle: bool,
    num_epochs: int,
    num_rollouts: int | None,
    split: int,
) -> None:
    assume(len(range(num_rows)[start:stop]) > 0)
    path = tmp_path_factory.getbasetemp() / f"rows{num_rows}.jsonl"
    if not path.exists():
        write_jsonl(path, numbered_rows(num_rows))
    bounds = f"{'' if start is None else start}:{'' if stop is None else stop}"
    config = PromptSource.Config(
        path=f"{path}@[{bounds}]",
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        num_rollouts=num_rollouts,
    )
    expected = draw_uids(PromptSource.open(config))
    source = PromptSource.open(config)
    head = draw_uids(source, split)
    assert head + draw_uids(resumed(source, config)) == expected
    assert len(set(expected)) == len(expected)
