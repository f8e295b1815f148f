"""SFT data: chat and pair rows, token-exact loss masks, bad rows named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asyncrl.buffer.sources import DataError
from asyncrl.trainers.sft import SFTConfig, batches, load_examples
from tests.tiny_tokenizer import build_chatml_tokenizer

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3="},
    {"role": "assistant", "content": "6"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


def write(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def trained_text(tokenizer, ex) -> str:
    return tokenizer.decode(ex.tokens[ex.loss_mask == 1])


def test_chat_rows_train_only_what_the_template_adds_for_assistant_turns(tokenizer, tmp_path):
    cfg = SFTConfig(data=write(tmp_path / "d.jsonl", [{"messages": CHAT}]))
    (ex,) = load_examples(cfg, tokenizer)
    # The ChatML template renders each assistant turn as "<|im_start|>assistant\n" (the
    # generation prompt, not trained) followed by "CONTENT<|im_end|>\n" (trained).
    assert trained_text(tokenizer, ex) == "4<|im_end|>\n6<|im_end|>\n"
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ex.tokens.tolist() == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ex.tokens.dtype == np.int32 and ex.loss_mask.shape == ex.tokens.shape


def test_tool_use_traces_render_their_tools_and_train_only_the_assistant_turns(tokenizer, tmp_path):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    trace = [
        {"role": "user", "content": "6*7"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "#### 42"},
    ]
    cfg = SFTConfig(data=write(tmp_path / "d.jsonl", [{"messages": trace, "tools": tools}]))
    (ex,) = load_examples(cfg, tokenizer)
    full = tokenizer.apply_chat_template(trace, tools=tools, tokenize=False)
    assert "# Tools" in full  # the row's tools reached the template
    assert ex.tokens.tolist() == tokenizer(full, add_special_tokens=False)["input_ids"]
    call = '<tool_call>{"name": "calculator"}</tool_call><|im_end|>\n'
    assert trained_text(tokenizer, ex) == call + "#### 42<|im_end|>\n"  # not the tool's 42
    bad = write(tmp_path / "e.jsonl", [{"messages": trace, "tools": "calculator"}])
    with pytest.raises(DataError, match=r"e\.jsonl:1: tools must be a list"):
        load_examples(SFTConfig(data=bad), tokenizer)


def test_pair_rows_train_the_response_and_eos(tokenizer, tmp_path):
    cfg = SFTConfig(data=write(tmp_path / "d.jsonl", [{"prompt": "1+1=", "response": "2"}]))
    (ex,) = load_examples(cfg, tokenizer)
    assert trained_text(tokenizer, ex) == "2<|im_end|>"
    assert tokenizer.decode(ex.tokens) == "1+1=2<|im_end|>"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ('{"messages": [}', r"d\.jsonl:2: invalid JSON"),
        ({"text": "hi"}, r"d\.jsonl:2: expected 'messages' \(chat\) or 'prompt' and 'response'"),
        ({"messages": "hi"}, r"d\.jsonl:2: 'messages' is a string"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"d\.jsonl:2: message 0 .* role 'bot'"),
        ({"messages": [{"role": "user", "content": "x"}]}, r"d\.jsonl:2: nothing to learn"),
        ({"prompt": "x", "response": 3}, r"d\.jsonl:2: prompt and response must be strings"),
        ({"prompt": "x", "response": "y" * 300}, r"d\.jsonl:2: \d+ tokens > max_len 64"),
    ],
)
def test_a_bad_row_is_refused_with_its_file_and_line(tokenizer, tmp_path, row, match):
    path = write(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "fine"}, row])
    with pytest.raises(DataError, match=match):
        load_examples(SFTConfig(data=path, max_len=64), tokenizer)


def test_batches_cover_every_example_once_per_epoch_in_a_new_order(tokenizer, tmp_path):
    rows = [{"prompt": f"{i}+0=", "response": str(i)} for i in range(10)]
    cfg = SFTConfig(data=write(tmp_path / "d.jsonl", rows), batch_size=4, epochs=2, seed=1)
    examples = load_examples(cfg, tokenizer)
    got = [[e.where for e in b] for b in batches(examples, cfg)]
    assert [len(b) for b in got] == [4, 4, 2, 4, 4, 2]
    first, second = [w for b in got[:3] for w in b], [w for b in got[3:] for w in b]
    assert sorted(first) == sorted(second) == sorted(e.where for e in examples)
    assert first != second


def nll(model_dir: Path, examples) -> float:
    """Mean NLL of the trained tokens under the model saved in ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.as_tensor(ex.tokens, dtype=torch.long)[None]
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            token_logp = logp.gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.as_tensor(ex.loss_mask[1:], dtype=torch.bool)
            total -= float(token_logp[mask].sum())
            count += int(mask.sum())
    return total / count


def test_asyncrl_sft_trains_a_tiny_model_on_a_jsonl_file(tmp_path):
    from asyncrl.cli import main
    from tests.tiny_model import build_tiny_model

    _, tokenizer = build_tiny_model(tmp_path / "base")
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(4) for b in range(4)]
    rows += [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]}
    ]
    data = write(tmp_path / "arith.jsonl", rows)
    out = tmp_path / "run"
    args = ["sft", "--model", str(tmp_path / "base"), "--data", data, "--output-dir", str(out)]
    args += ["--epochs", "6", "--batch-size", "6", "--lr", "3e-3", "--max-tokens-per-gpu", "64"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 19))  # ceil(17 / 6) * 6 epochs
    examples = load_examples(SFTConfig(data=data), tokenizer)
    before, after = nll(tmp_path / "base", examples), nll(out / "model", examples)
    assert after < 0.5 * before, (before, after)
    assert json.loads((out / "config.json").read_text())["trainer"]["lr"] == 3e-3


def test_asyncrl_sft_refuses_bad_config_and_bad_data_before_training(tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["sft", "--model", str(tmp_path), "--data", "x.jsonl", "--epochs", "0"]) == 2
    assert "epochs: Input should be greater than or equal to 1" in capsys.readouterr().err
    args = ["sft", "--model", str(tmp_path), "--data", "x.jsonl", "--label-smoothing", "1"]
    assert main(args) == 2
    assert "label_smoothing: " in capsys.readouterr().err
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "base")
    data = write(tmp_path / "d.jsonl", [{"prompt": "1+1=", "response": "2"}, {"text": "x"}])
    args = ["sft", "--model", str(tmp_path / "base"), "--data", data]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    assert "d.jsonl:2: expected 'messages'" in capsys.readouterr().err
