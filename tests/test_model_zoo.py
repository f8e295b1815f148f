"""asyncrl/model_zoo.py: a model built once, however many processes ask for it together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.model_zoo import smollm2_dir

BUILD = """
import sys, time
from pathlib import Path
from asyncrl import model_zoo

def convert(gguf, out):  # stands for the dequantization: slow enough for the two to meet
    log = Path(sys.argv[2])
    with log.open("a") as f:
        f.write("start\\n")
    time.sleep(0.5)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    with log.open("a") as f:
        f.write("end\\n")

model_zoo._gguf_file = lambda: Path("model.gguf")
model_zoo._convert = convert
print(model_zoo.smollm2_dir(Path(sys.argv[1])))
"""


def test_two_processes_asking_at_once_build_the_model_once(tmp_path: Path) -> None:
    out, log = tmp_path / "smollm2", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(out), str(log)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    assert [p.communicate(timeout=60)[0].strip() for p in procs] == [str(out)] * 2
    assert log.read_text().split() == ["start", "end"]  # one build; the other waited for it
    assert (out / "config.json").exists() and smollm2_dir(out) == out
