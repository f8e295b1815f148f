"""The bad-input corpus (``tests/bad_inputs/``): every file gets a clear, specific error
that names where the problem is, before anything starts; truncated checkpoints are refused
with the checkpoint named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from asyncrl.buffer.checkpoint import read_checkpoint, write_checkpoint
from asyncrl.buffer.hub import Hub
from asyncrl.buffer.sources import DataError, PromptSource
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.config import ConfigError, load_config
from asyncrl.errors import CheckpointUnreadable
from asyncrl.policies import PolicyConfig
from asyncrl.trainers.torch_trainer import TorchTrainer
from tests.buffer_sim import ListSource, make_prompts
from tests.tiny_model import build_tiny_model

CORPUS = Path(__file__).parent / "bad_inputs"

DATA = {
    "truncated_row.jsonl": r"truncated_row\.jsonl:3: invalid JSON",
    "missing_prompt_key.jsonl": (
        r"missing_prompt_key\.jsonl:2: missing key 'prompt' \(row has keys: 'question', 'label'\)"
    ),
    "empty.jsonl": r"empty\.jsonl has no rows",
    "prompt_not_text.jsonl": r"prompt_not_text\.jsonl:2: 'prompt' is a number, expected a string",
    "row_not_object.jsonl": r"row_not_object\.jsonl:2: row is an array, expected an object",
    "not_utf8.jsonl": r"not_utf8\.jsonl:2: invalid JSON",
    "lone_surrogate.jsonl": (
        r"lone_surrogate\.jsonl:2: a lone UTF-16 surrogate escape \('\\ud800'\) is not text"
    ),
}  # fmt: skip

CONFIG = {
    "broken_yaml.yaml": r"broken_yaml\.yaml:4:1: invalid YAML",
    "misspelled_section.yaml": (
        r"misspelled_section\.yaml:2: unknown key 'bufer' \(did you mean 'buffer'\?\)"
    ),
    "negative_lr.yaml": (
        r"negative_lr\.yaml:4: trainer\.lr \(--lr\): Input should be greater than 0, got -1"
    ),
    "wrong_type.yaml": (
        r"wrong_type\.yaml:3: buffer\.max_staleness: .*got \"two\""
    ),
    "megatron_with_a_critic.yaml": (
        r"megatron_with_a_critic\.yaml:6: algo\.advantage_estimator \(--advantage-estimator\): "
        r"ppo needs a critic, which the megatron backend does not train"
    ),
    "megatron_compiled.yaml": (
        r"megatron_compiled\.yaml:2: trainer: trainer\.backend=megatron does not use compile"
    ),
    "megatron_tp_without_ranks.yaml": (
        r"megatron_tp_without_ranks\.yaml:2: trainer: trainer\.num_ranks=1 is not a multiple "
        r"of TP 2 x PP 1"
    ),
    "megatron_with_fsdp.yaml": (
        r"megatron_with_fsdp\.yaml:2: trainer: trainer\.backend=megatron does not use parallel"
    ),
    "sim_engine_without_a_vocabulary.yaml": (
        r"sim_engine_without_a_vocabulary\.yaml:3: rollout\.engine: the sim engine takes its "
        r"vocabulary from tests/bad_inputs/data/config\.json, which has none"
    ),
    "duplicate_key.yaml": (
        r"duplicate_key\.yaml:3: duplicate key 'trainer\.lr' \(first at line 2\)"
    ),
    "repeated_section.yaml": (
        r"repeated_section\.yaml:5: duplicate key 'buffer' \(first at line 1\)"
    ),
    "inconsistent_values.yaml": (
        r"inconsistent_values\.yaml:2: .*heartbeat_timeout \(2\.0\) must be greater "
        r"than heartbeat_interval \(5\.0\)"
    ),
}  # fmt: skip


def test_the_corpus_and_its_expectations_match():
    assert sorted(p.name for p in (CORPUS / "data").iterdir()) == sorted(DATA)
    assert sorted(p.name for p in (CORPUS / "config").iterdir()) == sorted(CONFIG)


@pytest.mark.parametrize("name", sorted(DATA))
def test_a_bad_data_file_is_refused_naming_file_and_line(name: str):
    with pytest.raises(DataError) as info:
        PromptSource.open(PromptSource.Config(path=str(CORPUS / "data" / name)))
    assert re.search(DATA[name], str(info.value)), str(info.value)


@pytest.mark.parametrize("name", sorted(CONFIG))
def test_a_bad_config_file_is_refused_naming_file_line_and_key(name: str):
    with pytest.raises(ConfigError) as info:
        load_config(str(CORPUS / "config" / name))
    assert re.search(CONFIG[name], str(info.value)), str(info.value)


def test_a_truncated_buffer_checkpoint_is_refused_with_its_name(tmp_path: Path):
    hub = Hub(VersionedBuffer(VersionedBuffer.Config(), ListSource(make_prompts(4))))
    hub.hand_out("rollout-0", "r1", 2)
    hub.commit()
    whole, cut = tmp_path / "buffer.ckpt", tmp_path / "cut.ckpt"
    write_checkpoint(hub.state_dict(), whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert read_checkpoint(whole) == hub.state_dict()
    # Permanent: a restart would read the same bytes (the actor is not restarted).
    with pytest.raises(CheckpointUnreadable, match=r"buffer checkpoint .*cut\.ckpt is unreadable"):
        read_checkpoint(cut)
    (tmp_path / "other.ckpt").write_bytes(b'{"not": "a checkpoint"}')
    with pytest.raises(ValueError, match="not a buffer checkpoint"):
        read_checkpoint(tmp_path / "other.ckpt")


def test_a_truncated_trainer_checkpoint_is_refused_with_its_name(tmp_path: Path):
    build_tiny_model(tmp_path / "model")
    config = TorchTrainer.Config(model_path=str(tmp_path / "model"), lr=1e-3)
    TorchTrainer(config).save_checkpoint(tmp_path / "step_1")
    weights = next((tmp_path / "step_1").rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointUnreadable, match=r"trainer checkpoint .*step_1 is unreadable"):
        TorchTrainer(config).load_checkpoint(tmp_path / "step_1")
    (tmp_path / "step_1" / "trainer.json").write_text("{")
    with pytest.raises(ValueError, match="JSONDecodeError"):
        TorchTrainer(config).load_checkpoint(tmp_path / "step_1")


def test_a_trainer_checkpoint_missing_a_part_is_refused_never_half_loaded(tmp_path: Path):
    """A truncated or missing RNG file of this rank, or a missing critic: unreadable (a
    permanent error, not a restart, not a stream silently reseeded)."""
    build_tiny_model(tmp_path / "model")
    config = TorchTrainer.Config(model_path=str(tmp_path / "model"), lr=1e-3)
    ppo = PolicyConfig(advantage_estimator="ppo")
    TorchTrainer(config, ppo).save_checkpoint(tmp_path / "step_1")
    rng = tmp_path / "step_1" / "rng" / "rank0.pt"
    whole = rng.read_bytes()
    rng.write_bytes(whole[:100])
    with pytest.raises(CheckpointUnreadable, match=r"step_1 is unreadable"):
        TorchTrainer(config, ppo).load_checkpoint(tmp_path / "step_1")
    rng.unlink()
    with pytest.raises(CheckpointUnreadable, match=r"rank0\.pt is missing \(written by 1 rank"):
        TorchTrainer(config, ppo).load_checkpoint(tmp_path / "step_1")
    state = json.loads((tmp_path / "step_1" / "trainer.json").read_text())
    (tmp_path / "step_1" / "trainer.json").write_text(json.dumps(state | {"world_size": 2}))
    TorchTrainer(config, ppo).load_checkpoint(tmp_path / "step_1")  # other ranks: reseeded
    rng.write_bytes(whole)
    shutil.rmtree(tmp_path / "step_1" / "critic")
    with pytest.raises(CheckpointUnreadable, match=r"has no critic/, and this trainer trains"):
        TorchTrainer(config, ppo).load_checkpoint(tmp_path / "step_1")
    TorchTrainer(config).load_checkpoint(tmp_path / "step_1")  # grpo: no critic to read


def test_a_row_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": "' + "x" * 5000 + '"}\n')
    with pytest.raises(DataError, match=r"big\.jsonl:2: the row is 0\.0 MiB, over the 4096 bytes"):
        PromptSource.open(PromptSource.Config(path=str(path), max_row_bytes=4096))
