"""The HTTP front's routes over the scoring service (FastAPI; OpenAPI at ``/docs``).

* ``POST /v1/completions`` (OpenAI / vLLM), ``POST /generate`` (SGLang): scoring.
* ``GET /v1/models``; ``GET /health`` (200 once serving, 503 while loading or
  draining; ``/health_generate`` and ``/ping`` answer the same); ``GET /tokenizer_info``,
  ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes).

Every route shares :func:`megascore_server.http.calls.run` (gate, deadline, disconnect,
metrics, errors); the bearer token and the body-size limit are the
:class:`~megascore_server.http.guard.Guard`'s; errors raised before a route runs (bad
JSON, wrong types, unknown routes) are answered here, all in OpenAI's error shape.
Nothing here decides what a call may do: the service does.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from megascore_server.http import calls
from megascore_server.http.bodies import BodyParser
from megascore_server.http.completions import FIELDS as COMPLETION_FIELDS
from megascore_server.http.completions import CompletionRequest, complete
from megascore_server.http.errors import HttpError, error_response, json_response
from megascore_server.http.generate import FIELDS as GENERATE_FIELDS
from megascore_server.http.generate import GenerateRequest, generate
from megascore_server.http.guard import OPEN_PATHS, Guard
from megascore_server.metrics import ServerMetrics
from megascore_server.service import ScoringService, new_request_id


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[StrictInt]


def _field(loc) -> str:
    """A pydantic location as the caller wrote it (``prompt[0][2]``): the type tags of
    union alternatives (``list[int]``, ``str``) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int) or str(part).isdigit():
            out += f"[{part}]"
        elif part != "body" and "[" not in str(part) and str(part) not in _TYPE_TAGS:
            out += f".{part}" if out else str(part)
    return out or "body"


_TYPE_TAGS = {"str", "int", "bool", "float", "dict", "list", "none", "function-after"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The most specific pydantic error as ``field: problem``."""
    errors = exc.errors()
    if not errors:
        return "body: invalid request", None
    if errors[0].get("type") == "json_invalid":
        return f"body: not valid JSON ({errors[0].get('ctx', {}).get('error', 'invalid')})", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    field = _field(first.get("loc", ()))
    return f"{field}: {first.get('msg', 'invalid')}", field


def build_app(
    service: ScoringService,
    metrics: ServerMetrics,
    *,
    token: str | None,
    max_body_bytes: int,
    bodies: BodyParser,
) -> Guard:
    """The HTTP front's ASGI app: the routes behind the :class:`Guard`.

    Args:
        service: the scoring service every route calls.
        metrics: the server's metrics (``front="http"``).
        token: the bearer token every route but the probes needs (None: no auth).
        max_body_bytes: the largest body accepted (413 above).
        bodies: parses the routes' bodies (its owner closes it).
    """
    app = FastAPI(title="megascore", summary="Megatron-exact sequence scoring (docs/http.md)")

    def route_of(path: str) -> str:
        """The metrics label of ``path``: itself when a route has it, else ``other``."""
        return path if any(getattr(r, "path", None) == path for r in app.routes) else "other"

    def run(request, route, work, fields=None, gated=True):
        return calls.run(request, route, service, metrics, work, fields=fields, gated=gated)

    _add_error_handlers(app, metrics, route_of)
    _add_scoring_routes(app, service, run, bodies)
    _add_model_routes(app, service, run)
    _add_tokenizer_routes(app, service, run, bodies)
    return Guard(app, metrics, token=token, max_body_bytes=max_body_bytes, route_of=route_of)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics, route_of) -> None:
    """A body FastAPI could not parse and an unknown route: 4xx in the OpenAI error shape."""

    def counted(request: Request, response):
        route, status = route_of(request.url.path), str(response.status_code)
        metrics.observe_request(route, status, 0.0, front="http")
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return counted(request, error_response(HttpError(400, message, field)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        error = HttpError(exc.status_code, f"{request.url.path}: {exc.detail}")
        return counted(request, error_response(error))


def _body_of(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of a route that parses its own body (:mod:`.bodies`) as ``model``."""
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}}
    return {"requestBody": {**schema, "required": True}}


def _add_scoring_routes(app: FastAPI, service: ScoringService, run, bodies: BodyParser) -> None:
    """vLLM's ``/v1/completions`` and SGLang's ``/generate``."""

    @app.post("/v1/completions", openapi_extra=_body_of(CompletionRequest))
    async def completions(request: Request):
        body = await bodies.parse(CompletionRequest, request, "prompt")
        request_id = new_request_id("cmpl")
        return await run(
            request,
            "/v1/completions",
            lambda arrival, deadline: complete(service, body, request_id, arrival, deadline),
            COMPLETION_FIELDS,
        )

    @app.post("/generate", openapi_extra=_body_of(GenerateRequest))
    async def sglang_generate(request: Request):
        body = await bodies.parse(GenerateRequest, request, "input_ids")
        request_id = new_request_id("gen")
        return await run(
            request,
            "/generate",
            lambda arrival, deadline: generate(service, body, request_id, arrival, deadline),
            GENERATE_FIELDS,
        )


def _add_model_routes(app: FastAPI, service: ScoringService, run) -> None:
    """``/v1/models`` and the health probes (:data:`OPEN_PATHS`)."""

    @app.get("/v1/models")
    async def models(request: Request):
        async def work(arrival, deadline):
            described = await service.describe()
            return json_response({"object": "list", "data": model_cards(described)})

        return await run(request, "/v1/models", work, gated=False)

    async def health(request: Request):
        async def work(arrival, deadline):
            service.gate.check()
            return json_response({"status": "serving"})

        return await run(request, "/health", work, gated=False)

    for path in OPEN_PATHS:
        app.add_api_route(path, health, methods=["GET"])


def model_cards(described) -> list[dict]:
    """``/v1/models``' entries: the served model (the default weight set), then every
    other name a request's ``model`` may take (``ModelInfo.models``: weight sets), with
    its weights version; ``parent`` names the set an entry runs on (vLLM's adapters)."""
    info, created = described.info, int(time.time())
    card = {
        "id": info.name,
        "object": "model",
        "created": created,
        "owned_by": "megascore",
        "root": info.checkpoint_path or info.name,
        "max_model_len": described.limits.max_sequence_length,
        "weights_version": described.weights_version,
    }
    others = [
        {**card, "id": m.name, "weights_version": m.weights_version, "parent": m.base or None}
        for m in info.models[1:]
    ]
    return [card, *others]


def _add_tokenizer_routes(app: FastAPI, service: ScoringService, run, bodies: BodyParser) -> None:
    """``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` (the server's tokenizer)."""

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        async def work(arrival, deadline):
            service.tokenize([])  # the same refusal as gRPC without a tokenizer
            return json_response(service.tokenizer.info)

        return await run(request, "/tokenizer_info", work, gated=False)

    @app.post("/tokenize", openapi_extra=_body_of(TokenizeRequest))
    async def tokenize(request: Request):
        body = await bodies.parse(TokenizeRequest, request)

        async def work(arrival, deadline):
            (ids,) = service.tokenize([body.prompt], body.add_special_tokens)
            limits = service.limits
            return json_response(
                {"count": len(ids), "max_model_len": limits.max_sequence_length, "tokens": ids}
            )

        return await run(request, "/tokenize", work, gated=False)

    @app.post("/detokenize", openapi_extra=_body_of(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await bodies.parse(DetokenizeRequest, request)

        async def work(arrival, deadline):
            ids = _ids(body.tokens)
            (text,), _ = service.detokenize(ids, np.array([ids.size], np.int64))
            return json_response({"prompt": text})

        return await run(request, "/detokenize", work, {"token_ids": "tokens"}, gated=False)


def _ids(values: list[Any]) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise HttpError(400, "tokens: ids must fit in int64", "tokens") from None
