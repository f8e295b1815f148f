"""SGLangClient through the real sglang-router (pip ``sglang-router``, a Rust binary on CPU).

The router runs as a subprocess on 127.0.0.1 (``python -m sglang_router.launch_router``);
workers register with ``POST /workers`` through the client's helpers. Two worker kinds:
recorded fake SGLang servers, and two ``asyncrl serve`` processes on the tiny model.
Generation goes through the router; control calls
go to each worker, as slime does (the router does not fan them out).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from asyncrl.engines.client.sglang import GenerateResult, SGLangClient
from tests.test_sglang_client import IDS, TRIPLES, Fake, chunk, free_port, serving, sse, stream

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (pip install sglang-router, in the dev extra)",
    ),
]

FAST = SGLangClient.Config(backoff_s=0.05, control_timeout_s=10.0, generate_timeout_s=60.0)
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Poll ``GET /health`` until 200; fail with the log tail if the process dies or hangs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.1)
    pytest.fail(f"{url} not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def process(args: list[str], url: str, log: Path, timeout_s: float) -> Iterator[str]:
    """Run ``args`` with output to ``log``; yield ``url`` once healthy; stop it after."""
    with spawned(args, log) as proc:
        wait_healthy(url, proc, log, timeout_s)
        yield url


@contextlib.contextmanager
def spawned(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` with output to ``log``; stop it after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[str]:
    """A fresh sglang-router with no workers (round robin, so both workers get traffic)."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        # Registration health-checks a worker at once, then retries at this period (30 s).
        "--worker-startup-check-interval",
        "1",
    ]
    with process(args, f"http://127.0.0.1:{port}", tmp_path / "router.log", 20) as url:
        yield url


@pytest.fixture
async def client(router: str) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(router, router=True, config=FAST) as c:
        yield c


async def test_the_router_carries_generate_and_streams_to_registered_fake_workers(client, router):
    final = chunk(IDS, 8, triples=TRIPLES, finish={"type": "stop", "matched": 151645})
    async with serving(Fake()) as a, serving(Fake()) as b:
        ids = [await client.add_worker(a.url), await client.add_worker(b.url)]
        assert sorted(w["id"] for w in await client.list_workers()) == sorted(ids)
        results = [await client.generate([1, 2, 3], GREEDY, rid=f"g{i}") for i in range(2)]
        assert all(r.output_ids == IDS and r.engine == router for r in results)
        for fake in (a, b):
            fake.generate.append(stream(sse(chunk(IDS[:3], 3), final), pieces=4))
        streamed = [[len(r.output_ids) async for r in client.generate_stream([1])] for _ in "ab"]
        assert streamed == [[3, 8], [3, 8]]
        await client.abort(abort_all=True)
        await client.remove_worker(a.url)
        assert [w["url"] for w in await client.list_workers()] == [b.url]
    for fake in (a, b):
        # The router re-serialises the body with extra keys; ours survive unchanged.
        (sent, _) = fake.bodies("/generate")
        assert sent["rid"] in ("g0", "g1") and sent["sampling_params"] == GREEDY
        assert fake.bodies("/abort_request") == [{"abort_all": True}]


# ----------------------------------------------------------------------------- asyncrl serve


def serve_command() -> list[str]:
    script = Path(sys.executable).with_name("asyncrl")
    if script.exists():
        return [str(script), "serve"]
    return [
        sys.executable,
        "-c",
        "import sys; from asyncrl.cli import main; sys.exit(main())",
        "serve",
    ]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """Two ``asyncrl serve`` processes on the tiny model: (model dir, worker URLs). They
    start side by side: most of a start is imports, one core each."""
    from tests.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("router")
    build_tiny_model(root / "model")  # conftest keeps the hub offline for the children too
    with contextlib.ExitStack() as stack:
        ports = {free_port(), free_port()}
        while len(ports) < 2:
            ports.add(free_port())
        started = []
        for name, port in zip(("w0", "w1"), sorted(ports), strict=True):
            args = [*serve_command(), "--model", str(root / "model"), "--port", str(port)]
            log = root / f"{name}.log"
            proc = stack.enter_context(spawned(args, log))
            started.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in started:
            wait_healthy(url, proc, log, 60)
        yield str(root / "model"), [url for url, _, _ in started]


@pytest.fixture
async def routed(client, workers) -> AsyncIterator[SGLangClient]:
    for url in workers[1]:
        await client.add_worker(url)
    yield client


async def test_generate_and_stream_through_the_router_agree_token_for_token(routed, workers):
    prompt = list(range(20, 40))
    plain = [await routed.generate(prompt, GREEDY) for _ in workers[1]]
    streamed = [await routed.generate(prompt, GREEDY, stream=True) for _ in workers[1]]
    for result in plain + streamed:
        assert result.output_ids == plain[0].output_ids and len(result.output_ids) == 12
        assert len(result.logprobs or []) == 12 and len(result.versions) == 12
        assert result.finish_reason is not None and result.finish_reason.type == "length"
        assert result.prompt_tokens == len(prompt)
    for a, b in zip(plain[0].logprobs or [], streamed[0].logprobs or [], strict=True):
        assert abs(a - b) < 1e-4


async def test_abort_through_the_router_answers_each_call_with_its_partial_output(routed):
    long = {"temperature": 1.0, "max_new_tokens": 480, "ignore_eos": True}
    first = asyncio.Event()

    async def run(i: int) -> GenerateResult:
        results = []
        async for result in routed.generate_stream([5, 9, 11], long, rid=f"long-{i}"):
            first.set()
            results.append(result)
        return results[-1]

    calls = [asyncio.create_task(run(i)) for i in range(6)]
    await asyncio.wait_for(first.wait(), 30)
    await routed.abort_all_and_wait(timeout_s=30)
    results = await asyncio.gather(*calls)
    assert any(r.aborted for r in results)
    for r in results:
        assert len(r.logprobs or []) == len(r.output_ids) == len(r.versions)
        assert r.aborted or len(r.output_ids) == 480


async def test_weight_updates_go_to_each_worker_and_stamp_new_tokens(routed, workers):
    model, urls = workers
    before = await routed.weight_version()
    await routed.update_weights(before + 1, path=model)
    assert await routed.weight_version() == before + 1
    for url in urls:
        assert await routed.weight_version(url) == before + 1
    result = await routed.generate([1, 2, 3], GREEDY)
    assert result.weight_version == before + 1 and set(result.versions) == {before + 1}
