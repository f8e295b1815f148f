"""The tool registry and the built-in tools: calculator, Python sandbox, BM25 search."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import socket
import time
from typing import Any

import pytest

from asyncrl.buffer.sources import DataError
from asyncrl.rollout.tools import (
    FunctionTool,
    PythonSandbox,
    SandboxLimits,
    ToolRegistry,
    calculator_tool,
    landlock,
    python_tool,
    search_tool,
)
from asyncrl.rollout.tools.calculator import CalculatorError, evaluate, format_number
from asyncrl.rollout.tools.search import BM25Index, Document, load_corpus
from tests.polling import alive

ECHO_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
    "required": ["text"],
    "additionalProperties": False,
}


async def echo(text: str, times: int = 1) -> str:
    return text * times


async def nothing() -> None:
    return None


async def boom() -> str:
    raise RuntimeError("disk on fire")


async def hang() -> str:
    await asyncio.sleep(60)
    return "never"


@dataclasses.dataclass(frozen=True)
class _Raw:
    """A Tool (not a FunctionTool) whose body returns whatever it returns."""

    name: str
    description: str
    fn: Any
    parameters: dict[str, Any]

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


@pytest.fixture
def registry() -> ToolRegistry:
    tools = [
        FunctionTool("echo", "Repeat text.", echo, ECHO_SCHEMA),
        FunctionTool("boom", "Always raises.", boom),
        FunctionTool("hang", "Never returns.", hang),
        FunctionTool("upper", "Sync body.", lambda text: text.upper(), ECHO_SCHEMA),
        _Raw("raw", "Returns None, not text.", nothing, {"type": "object"}),
        calculator_tool(),
    ]
    return ToolRegistry(tools, timeout_s=0.3, max_output_chars=200)


# -- the registry ---------------------------------------------------------------------------


async def test_a_valid_call_returns_the_tools_output(registry):
    result = await registry.call("echo", '{"text": "ab", "times": 3}')
    assert (result.ok, result.content, result.name) == (True, "ababab", "echo")
    assert (await registry.call("upper", {"text": "sync"})).content == "SYNC"  # in a thread


@pytest.mark.parametrize(
    ("name", "arguments", "reason"),
    [
        ("nope", "{}", "unknown tool 'nope'; available: echo, boom, hang, upper, raw, calculator"),
        ("raw", None, "tool 'raw' returned NoneType, not text"),
        ("echo", '{"text": ', "arguments are not valid JSON"),
        ("echo", "[1, 2]", "arguments must be a JSON object, not list"),
        ("echo", "{}", "invalid arguments for 'echo' at arguments: 'text' is a required"),
        ("echo", '{"text": "a", "times": 0}', "at times: 0 is less than the minimum of 1"),
        ("echo", '{"text": "a", "extra": 1}', "Additional properties are not allowed"),
        ("boom", None, "RuntimeError: disk on fire"),
        ("hang", None, "tool 'hang' timed out after 0.3 s"),
    ],
)
async def test_every_failure_is_an_error_observation_never_an_exception(
    registry, name, arguments, reason
):
    result = await registry.call(name, arguments)
    assert not result.ok
    assert result.content == result.error
    assert result.content.startswith("Error: ")
    assert reason in result.content
    assert result.timed_out == (name == "hang")  # the metrics count timeouts apart


async def test_long_output_is_cut_and_says_how_much(registry):
    result = await registry.call("echo", {"text": "x", "times": 230})
    assert result.content == "x" * 200 + "\n[... 30 more characters cut]"
    assert (await registry.call("echo", {"text": "x", "times": 200})).content == "x" * 200


def test_schemas_are_openai_style_and_a_data_row_can_restrict_and_redescribe(registry):
    (calc,) = [s for s in registry.schemas() if s["function"]["name"] == "calculator"]
    assert calc["type"] == "function"
    assert calc["function"]["parameters"]["required"] == ["expression"]
    row = [{"type": "function", "function": {"name": "echo", "description": "Say it again."}}]
    narrowed = registry.for_row(row)
    assert narrowed.names == ["echo"]
    assert narrowed.schemas()[0]["function"]["description"] == "Say it again."
    assert narrowed.schemas()[0]["function"]["parameters"] == ECHO_SCHEMA
    with pytest.raises(ValueError, match="the data names tool 'web'"):
        registry.for_row([{"name": "web"}])


def test_bad_registrations_are_refused():
    reg = ToolRegistry([calculator_tool()])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(calculator_tool())
    with pytest.raises(ValueError, match="invalid JSON schema"):
        reg.register(FunctionTool("bad", "x", echo, {"type": "object", "properties": 3}))
    with pytest.raises(ValueError, match="must have type 'object'"):
        reg.register(FunctionTool("arr", "x", echo, {"type": "array"}))


# -- the calculator -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123456789 * 987654321", "121932631112635269"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("1 / 3", "0.333333333333"),
        ("-(2 + 3) * 4 - 10 // 3 + 17 % 5", "-21"),
        ("2 ** 64", "18446744073709551616"),
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2 - 0.3", "0"),  # exact: a decimal in the text is the fraction it reads as
        ("1e3 * 3", "3000"),
    ],
)
def test_the_calculator_is_exact(expression, value):
    assert format_number(evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("(1).real", "unsupported element Attribute"),
        ("1 +", "not an arithmetic expression"),
        ("9 ** 9 ** 9", "exponents must be whole numbers up to 64"),
        ("2 ** 0.5", "exponents must be whole numbers"),
        ("(10 ** 60) * (10 ** 60)", "more than 100 digits"),
        ("(((0.1**64)**64)**64)**64", "more than 100 digits"),  # tiny, but a huge fraction
        ("(2 ** 64) ** 64", "more than 100 digits"),
        ("1 / (2 - 2)", "division by zero"),
        ("1+" * 150 + "1", "longer than 200 characters"),
        ("'a' * 3", "unsupported element Constant"),
        ("1e999", "not a finite number"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason.replace("*", r"\*")):
        evaluate(expression)


async def test_a_refused_expression_reaches_the_model_as_an_error(registry):
    result = await registry.call("calculator", {"expression": "open('/etc/passwd')"})
    assert not result.ok and "CalculatorError: unsupported element Call" in result.content


# -- the Python sandbox ---------------------------------------------------------------------
ISOLATION = landlock.problem() is None
ESCAPES = """
import os, socket, json, math
results = {"stdlib": json.dumps([math.pi])[:5]}
open("mine.txt", "w").write("ok")
results["own folder"] = open("mine.txt").read()
def attempt(name, fn):
    try:
        fn()
        results[name] = "allowed"
    except OSError as exc:
        results[name] = type(exc).__name__
attempt("job file", lambda: open(SECRET).read())
attempt("list /", lambda: os.listdir("/"))
attempt("the actor environ", lambda: open(f"/proc/{os.getppid()}/environ").read())
attempt("tcp connect", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2))
attempt("tcp bind", lambda: socket.socket().bind(("127.0.0.1", 0)))
udp = lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
attempt("udp", lambda: udp().sendto(b"x", ("127.0.0.1", PORT)))
attempt("unix socket file", lambda: socket.socket(socket.AF_UNIX).connect(IPC_PATH))
attempt("signal the actor", lambda: os.kill(os.getppid(), 0))
attempt("devnull", lambda: open(os.devnull, "w").write("x"))
print(json.dumps(results))
"""


@pytest.mark.skipif(not ISOLATION, reason=f"no isolation here: {landlock.problem()}")
async def test_an_isolated_snippet_reaches_none_of_the_jobs_files_sockets_or_processes(tmp_path):
    secret = tmp_path / "run" / "checkpoints" / "job.key_secret"
    secret.parent.mkdir(parents=True)
    secret.write_text("the job's key")
    listener = socket.create_server(("127.0.0.1", 0))  # a channel of the job
    ipc = socket.socket(socket.AF_UNIX)  # an ipc:// endpoint of the job
    ipc.bind(str(tmp_path / "job.sock"))
    ipc.listen()
    code = ESCAPES.replace("SECRET", repr(str(secret)))
    code = code.replace("IPC_PATH", repr(str(tmp_path / "job.sock")))
    code = code.replace("PORT", str(listener.getsockname()[1]))
    try:
        result = await PythonSandbox(LIMITS).run(code)
        # The same snippet without isolation reaches them: the test can tell the difference.
        loose = await PythonSandbox(LIMITS, isolate=False).run(code)
    finally:
        listener.close()
        ipc.close()
    assert result.returncode == 0, result.stderr
    denied = ["job file", "list /", "the actor environ", "tcp connect", "tcp bind", "udp",
              "unix socket file", "signal the actor"]  # fmt: skip
    assert json.loads(result.stdout) == {
        "stdlib": "[3.14",
        "own folder": "ok",
        "devnull": "allowed",  # what snippets need
        **dict.fromkeys(denied, "PermissionError"),
    }
    assert json.loads(loose.stdout) == {
        "stdlib": "[3.14",
        "own folder": "ok",
        "devnull": "allowed",
        **dict.fromkeys(denied, "allowed"),
    }


def test_a_kernel_without_landlock_refuses_an_isolated_sandbox(monkeypatch):
    monkeypatch.setattr(landlock, "abi", lambda: 0)
    refused = r"cannot isolate .*Landlock ABI >= 6 .*this kernel has none.*isolate: false"
    with pytest.raises(ValueError, match=refused):
        python_tool(LIMITS)
    assert python_tool(LIMITS, isolate=False).name == "python"


LIMITS = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=5.0, output_bytes=2000, file_bytes=4096)


async def test_a_program_runs_in_an_empty_directory_without_the_jobs_environment():
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'), sorted(os.environ))\n"
    code += "import asyncrl"
    result = await PythonSandbox(LIMITS).run(code)
    assert result.returncode == 1 and result.limit is None
    cwd, listing = result.stdout.splitlines()
    assert listing == "[] ['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert "asyncrl-sandbox-" in cwd
    assert not await asyncio.to_thread(os.path.exists, cwd)  # removed after the call
    assert "ModuleNotFoundError: No module named 'asyncrl'" in result.stderr
    assert result.observation().endswith("[exit status 1]")


async def test_cpu_time_is_limited():
    result = await PythonSandbox(LIMITS).run("while True:\n    pass")
    assert result.limit == "CPU-time limit of 1 s"
    assert result.seconds < LIMITS.wall_s


async def test_memory_is_limited():
    result = await PythonSandbox(LIMITS).run("x = bytearray(512 * 2**20)")
    assert result.returncode == 1
    assert "MemoryError" in result.stderr


async def test_file_size_is_limited():
    result = await PythonSandbox(LIMITS).run("open('f', 'wb').write(b'x' * 100_000)")
    assert result.returncode == 1
    assert "File too large" in result.stderr


async def test_wall_clock_is_limited():
    limits = SandboxLimits(cpu_s=1, wall_s=0.5)
    result = await PythonSandbox(limits).run("import time\ntime.sleep(30)")
    assert result.limit == "wall-clock limit of 0.5 s"
    assert result.observation() == "[stopped: wall-clock limit of 0.5 s]"


async def test_output_is_limited_and_the_writer_stopped():
    start = time.monotonic()
    result = await PythonSandbox(LIMITS).run("while True:\n    print('y' * 100)")
    assert result.limit == "output limit of 2000 bytes"
    assert len(result.stdout) == 2000 and result.truncated == ["stdout"]
    assert time.monotonic() - start < LIMITS.wall_s  # killed at the limit, not at wall_s


async def test_a_timed_out_call_leaves_no_process_behind(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    # Not isolated: the snippet writes its pid where the test can read it.
    tool = python_tool(SandboxLimits(wall_s=30), isolate=False)
    registry = ToolRegistry([tool], timeout_s=1.0)
    result = await registry.call("python", {"code": code})
    assert result.error == "Error: tool 'python' timed out after 1 s"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


async def test_a_child_that_outlives_the_program_is_killed_with_its_group(tmp_path):
    pid_file = tmp_path / "pid"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.close(1); os.close(2)\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(60)\n"
        "else:\n"
        "    time.sleep(0.5); print('parent done')\n"
    )
    result = await PythonSandbox(LIMITS, isolate=False).run(code)  # the pid file is outside
    assert result.returncode == 0 and result.stdout == "parent done\n"
    assert result.seconds < LIMITS.wall_s  # the child held the pipes: it did not hang us
    await asyncio.sleep(0.2)
    assert not await asyncio.to_thread(alive, int(pid_file.read_text()))


async def test_the_python_tool_returns_output_and_status():
    registry = ToolRegistry([python_tool(LIMITS)])
    result = await registry.call("python", {"code": "print(6 * 7)"})
    assert (result.ok, result.content) == (True, "42\n[exit status 0]")


# -- BM25 search ------------------------------------------------------------------------------

DOCS = [
    Document("a", "Paris", "Paris is the capital of France."),
    Document("b", "Berlin", "Berlin is the capital of Germany. Berlin has many museums."),
    Document("c", "Rivers", "The Seine flows through Paris."),
]


def test_bm25_scores_follow_the_formula():
    index = BM25Index(DOCS, k1=1.5, b=0.75)
    lengths = [7, 11, 6]  # title + text terms
    avgdl = sum(lengths) / 3

    def term_score(n: int, f: int, length: int) -> float:
        idf = math.log(1 + (3 - n + 0.5) / (n + 0.5))
        return idf * f * 2.5 / (f + 1.5 * (1 - 0.75 + 0.75 * length / avgdl))

    hits = index.search("berlin museums", k=3)
    assert [h.document.id for h in hits] == ["b"]
    expected = term_score(1, 3, 11) + term_score(1, 1, 11)
    assert hits[0].score == pytest.approx(expected)
    assert [h.document.id for h in index.search("Paris!")] == ["a", "c"]
    assert index.search("tokyo") == []


async def test_the_search_tool_reads_a_corpus_file_and_shows_the_top_hits(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    registry = ToolRegistry([search_tool(str(corpus), k=1, max_chars=12)])
    result = await registry.call("search", {"query": "capital of Germany"})
    assert result.content == "[1] Berlin (id b)\nBerlin is th..."
    assert (await registry.call("search", {"query": "zzz"})).content == "No results."


def test_a_corpus_row_without_text_names_its_file_and_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl:2: a corpus row needs a string 'text'"):
        load_corpus(str(corpus))


def test_tool_use_config_errors_are_refused_before_launch(tmp_path, capsys):
    from asyncrl.cli import main
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["train", "--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(data)]
    base += ["--output-dir", str(tmp_path / "run")]
    search = ["--rollout.tool-use.tools", '[{"type": "search"}]', "--apply-chat-template"]
    assert main([*base, *search]) == 2
    assert "the search tool needs corpus" in capsys.readouterr().err
    calc = ["--rollout.tool-use.tools", '[{"type": "calculator"}]']
    assert main([*base, *calc]) == 2
    assert "rollout.tool_use needs data.apply_chat_template" in capsys.readouterr().err
    missing = '[{"type": "search", "corpus": "' + str(tmp_path / "nope.jsonl") + '"}]'
    assert main([*base, "--rollout.tool-use.tools", missing, "--apply-chat-template"]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    # a chat template that cannot render an observation after a turn (not prefix-stable)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"
    tokenizer.save_pretrained(tmp_path / "model")
    assert main([*base, *calc, "--apply-chat-template"]) == 2
    assert "the chat template cannot render tool observations" in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()  # no actor was started
