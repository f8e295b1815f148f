"""SGLang's tokenizer routes: ``/tokenize`` and ``/detokenize`` (also under ``/v1``), with
SGLang's request and reply shapes (``TokenizeRequest``, ``DetokenizeRequest``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncrl.engines.server.generate_wire import Json, bad_request, invalid_body, json_response

if TYPE_CHECKING:
    from asyncrl.engines.server.app import EngineServer


class TokenRoutes:
    """Text to ids and back with the served model's tokenizer."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def register(self, router: web.UrlDispatcher) -> None:
        for prefix in ("", "/v1"):
            router.add_post(f"{prefix}/tokenize", self.tokenize)
            router.add_post(f"{prefix}/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": text | [text], "add_special_tokens": true}`` ->
        ``{"tokens", "count", "max_model_len"}`` (one list per text for a list)."""
        body, tokenizer = await self._body(request), self._tokenizer()
        prompt, special = body.get("prompt"), _flag(body, "add_special_tokens")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise invalid_body("prompt: expected a string or a list of strings")
        ids = [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]
        one = isinstance(prompt, str)
        reply = {
            "tokens": ids[0] if one else ids,
            "count": len(ids[0]) if one else [len(i) for i in ids],
            "max_model_len": self.server.context_length,
        }
        return json_response(reply)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": ids | [ids], "skip_special_tokens": true}`` -> ``{"text"}``."""
        body, tokenizer = await self._body(request), self._tokenizer()
        tokens, skip = body.get("tokens"), _flag(body, "skip_special_tokens")
        one = isinstance(tokens, list) and all(_is_id(t) for t in tokens)
        rows = [tokens] if one else tokens
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and all(_is_id(t) for t in r) for r in rows
        ):
            raise invalid_body("tokens: expected a list of token ids or a list of such lists")
        vocab = len(tokenizer)
        if any(t >= vocab for r in rows for t in r):
            raise bad_request(f"tokens: ids must be in [0, {vocab})")
        texts = [tokenizer.decode(r, skip_special_tokens=skip) for r in rows]
        return json_response({"text": texts[0] if one else texts})

    async def _body(self, request: web.Request) -> Json:
        body, _ = await self.server.read(request)
        if not isinstance(body, dict):
            raise invalid_body("expected a JSON object")
        return body

    def _tokenizer(self) -> Any:
        tokenizer = self.server.engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return tokenizer


def _flag(body: Json, key: str) -> bool:
    value = body.get(key, True)
    if not isinstance(value, bool):
        raise invalid_body(f"{key}: expected a boolean, got {value!r}")
    return value


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
