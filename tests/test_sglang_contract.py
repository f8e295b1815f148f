"""The weight-update wire, field by field, against SGLang's own request types.

Every body the client sends on a weight route (the calls of the ``disk`` and ``dist``
transports, and ``/update_weights_from_tensor``) is checked against the matching
``msgspec.Struct`` of SGLang's ``io_struct.py`` (``tests/sglang_types.py`` reads it from
the pinned wheel): each key is a field SGLang declares, each value fits its annotation,
and every field without a default is sent. And the embedded server takes a body of every
field SGLang declares, so a client written against SGLang can call it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch

from asyncrl.engines.client.sglang import SGLangClient, WeightBucket
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.torch.engine import TorchEngine
from tests.sglang_types import fits, request_fields, sglang_contract_error
from tests.test_server import call
from tests.test_sglang_client import FAST, Fake, serving
from tests.tiny_model import build_tiny_model

#: Route -> SGLang's request type.
ROUTES = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


def check_body(path: str, body: dict[str, Any]) -> None:
    fields = request_fields(ROUTES[path])
    unknown = set(body) - set(fields)
    assert not unknown, f"{path}: {sorted(unknown)} are not fields of {ROUTES[path]}"
    for key, value in body.items():
        assert fits(value, fields[key].annotation), (path, key, value, fields[key].annotation)
    missing = {f.name for f in fields.values() if f.required} - set(body)
    assert not missing, f"{path}: required {sorted(missing)} not sent"


async def test_every_weight_update_body_the_client_sends_is_an_sglang_request():
    buckets = [
        WeightBucket(names=["a"], dtypes=["bfloat16"], shapes=[[4, 2]]),
        WeightBucket(names=["b", "c"], dtypes=["float32", "float32"], shapes=[[3], [2, 2]],
                     load_format="flattened_bucket"),
    ]  # fmt: skip
    async with serving(Fake(version="0.5.23")) as fake:
        async with SGLangClient(fake.url, config=FAST) as client:
            await client.update_weights(3, path="/ckpt/3")
            await client.update_weights(3, path="/ckpt/3", pause_mode="in_place")
            pending = await client.weights.init_weights_update_group(
                "127.0.0.1", 29500, world_size=2, group_name="g", backend="gloo"
            )
            await pending
            await client.update_weights(
                4, buckets=buckets, broadcast=lambda bucket: None, group_name="g",
                pause_mode="retract",
            )  # fmt: skip
            await client.weights.destroy_weights_update_group("g")
            await client.weights.update_weights_from_tensor(
                [("a", torch.zeros(2))], version=5, flattened=True, flush_cache=False
            )
    checked = set()
    for sent in fake.calls:
        if sent.path in ROUTES:
            check_body(sent.path, sent.body)
            checked.add(sent.path)
    assert checked == set(ROUTES) - {"/update_weight_version"}, checked


def test_tensor_payloads_name_only_globals_an_sglang_server_unpickles():
    """What we send to /update_weights_from_tensor (tensors one by one, a flattened
    bucket, and the ipc transport's shared buckets) names only globals in SGLang's own
    SafeUnpickler allow-list: a server refuses, or dies on, any other."""
    import base64
    import io

    from asyncrl.weights import payload as tensor_payload
    from asyncrl.weights.share import SharedVersions
    from tests.sglang_types import safe_unpickler_globals

    named = [("a", torch.arange(4.0)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    handles, _ = (shared := SharedVersions()).share(1, dict(named))
    payloads = [tensor_payload.encode(named),
                tensor_payload.encode(tensor_payload.flattened(named)), *handles]  # fmt: skip
    seen: set[tuple[str, str]] = set()

    class Recording(tensor_payload._AllowListUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    for payload in payloads:
        Recording(io.BytesIO(base64.b64decode(payload))).load()
    shared.close()
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in seen
    assert seen <= safe_unpickler_globals(), seen - safe_unpickler_globals()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    model = tmp_path_factory.mktemp("contract") / "model"
    build_tiny_model(model)
    server = EngineServer(TorchEngine.from_pretrained(str(model)))
    yield await server.start("127.0.0.1", 0)
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("path", "refusal"),
    [
        ("/update_weights_from_distributed", "init it first"),
        ("/update_weights_from_tensor", "cannot be read"),
        ("/destroy_weights_update_group", "does not exist"),
        ("/update_weights_from_disk", "no *.safetensors"),
    ],
)
async def test_the_embedded_server_reads_a_body_of_every_sglang_field(
    http: aiohttp.ClientSession, url: str, path: str, refusal: str, tmp_path: Path
):
    """Every field SGLang declares, at a value of its type: refused only for what the
    request asks (no such group, an unreadable payload, no weights in the folder),
    never for a field."""
    values = {"str": "x", "int": 1, "bool": False, "List[str]": ["w"], "List[int]": [1],
              "List[List[int]]": [[1]], "Optional[str]": None,
              "Optional[Dict[str, Any]]": None}  # fmt: skip
    body = {}
    for field in request_fields(ROUTES[path]).values():
        if field.annotation in values:
            body[field.name] = values[field.annotation]
        elif field.annotation.startswith("Literal"):
            body[field.name] = "all"
        elif field.annotation.startswith("Annotated[List[bytes]"):
            body[field.name] = ["AAAA"]
    body |= {"dtypes": ["float32"], "weight_version": "7", "model_path": str(tmp_path)}
    body = {k: v for k, v in body.items() if k in request_fields(ROUTES[path])}
    assert set(body) == set(request_fields(ROUTES[path]))
    status, reply = await call(http, url, path, body)
    assert status == 400 and refusal in reply["message"], reply


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    "flags",
    [
        {"return_logprob": "true"},
        {"return_logprob": 1},
        {"return_logprob": ["true"]},
        {"return_logprob": True},
        {"return_logprob": [False]},
    ],
)
async def test_generate_refuses_what_sglangs_json_contract_refuses(
    http: aiohttp.ClientSession, url: str, flags: dict[str, Any]
):
    """SGLang's own contract (its generated ``api_types``) judges each body; the
    embedded server refuses the same with the same ``{"error": text}``, or serves it."""
    body = {"input_ids": [5, 6, 7] if not isinstance(flags["return_logprob"], list) else [[5, 6]],
            "sampling_params": {"max_new_tokens": 2}, **flags}  # fmt: skip
    await judged_as_sglang(http, url, body)


async def judged_as_sglang(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """``/generate`` refuses ``body`` as SGLang's contract does, in its words, or serves it."""
    want = sglang_contract_error(body)
    status, reply = await call(http, url, "/generate", body)
    if want is None:
        assert status == 200, reply
    else:
        assert (status, reply) == (400, {"error": want})


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    "fields",
    [
        {"top_logprobs_num": "2"},
        {"logprob_start_len": "0"},
        {"top_logprobs_num": [1.5]},
        {"logprob_start_len": True},
        {"top_logprobs_num": 2},
        {"token_ids_logprob": "5"},
        {"token_ids_logprob": 5},
        {"token_ids_logprob": ["5"]},
        {"token_ids_logprob": [["5"]]},
        {"token_ids_logprob": [5, 6]},
        {"token_ids_logprob": [[5, 6]]},
    ],
)
async def test_integer_fields_are_as_strict_as_sglangs_contract(
    http: aiohttp.ClientSession, url: str, fields: dict[str, Any]
):
    """``Int64OrList`` and ``TokenIdsOrList`` take JSON integers only: the same refusals,
    in SGLang's words, as its own contract; what it accepts is served."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True, **fields}  # fmt: skip
    await judged_as_sglang(http, url, body)


@pytest.mark.asyncio(loop_scope="module")
async def test_token_ids_logprob_reports_those_tokens_at_every_position(
    http: aiohttp.ClientSession, url: str
):
    """``*_token_ids_logprobs``: per position, the asked ids in their order, from the
    distribution the sampled tokens' log-probs come from (equal where an id was the one
    sampled, or the prompt's next token)."""
    prompt, greedy = [5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, free = await call(http, url, "/generate", {"input_ids": prompt, "sampling_params": greedy})
    ids = sorted({*free["output_ids"], *prompt})
    body = {"input_ids": prompt, "sampling_params": greedy, "return_logprob": True,
            "logprob_start_len": 0, "token_ids_logprob": ids}  # fmt: skip
    status, out = await call(http, url, "/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    chosen, sampled = meta["output_token_ids_logprobs"], meta["output_token_logprobs"]
    assert len(chosen) == len(out["output_ids"]) == 4
    for row, (logprob, token, _) in zip(chosen, sampled, strict=True):
        assert [t for _, t, _ in row] == ids
        assert dict((t, lp) for lp, t, _ in row)[token] == pytest.approx(logprob, abs=1e-6)
    inputs = meta["input_token_ids_logprobs"]
    assert inputs[0] is None and len(inputs) == len(prompt)
    for row, (logprob, token, _) in zip(inputs[1:], meta["input_token_logprobs"][1:], strict=True):
        assert dict((t, lp) for lp, t, _ in row)[token] == pytest.approx(logprob, abs=1e-6)
    plain = {**body, "return_logprob": False}
    _, off = await call(http, url, "/generate", plain)
    assert "output_token_ids_logprobs" not in off["meta_info"]  # only with return_logprob
    status, reply = await call(http, url, "/generate", {**body, "token_ids_logprob": [10**6]})
    assert status == 400 and "token_ids_logprob: ids must be in" in str(reply)
