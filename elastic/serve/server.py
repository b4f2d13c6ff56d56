"""HTTP face of the reference replica: an OpenAI-compatible subset plus ``/metrics`` and
``/health``.

* ``POST /v1/completions`` ``{"prompt": str, "max_tokens": int, "stream": bool}``: the
  completion (or SSE chunks ending in ``data: [DONE]``). A full queue answers 429, an engine
  that is not running 503; both with an OpenAI-style ``{"error": {...}}`` body. ``prompt``
  may be token ids (a list of ints, as OpenAI's API allows): how a handed-off request resumes.
* ``POST /admin/handoff``: the replica is leaving; every request it holds ends at once with
  ``finish_reason: "handoff"`` and a ``resume`` object (``{"prompt": [token ids: prompt +
  tokens so far], "max_tokens": tokens still owed}``) that a balancer posts to another replica
  to continue the same text; later requests get 503 (``type: "draining"``) and ``/health``
  503. Answers ``{"handed_off": n}``.
* ``GET /metrics``: vLLM-named metrics (Prometheus text). ``GET /health``: 200 when serving.
* ``GET /v1/models``: the one model.

It binds loopback by default; ``serve_forever`` / ``start_in_thread`` own the socket so a
caller asking for port 0 learns the real port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from elastic.model import load_model
from elastic.serve.engine import Draining, Engine, QueueFull, ReplicaMetrics
from elastic.serve.engine import Request as GenRequest
from elastic.serve.gpt import TinyGPT, encode


@dataclass(frozen=True)
class ReplicaConfig:
    model: str = "tiny"
    max_running: int = 8
    max_waiting: int = 64
    tokens_per_second: float = 50.0
    max_positions: int = 256
    max_tokens_limit: int = 128
    seed: int = 0


class CompletionRequest(BaseModel):
    prompt: str | list[int] = Field(description="text, or token ids (how a handed-off request resumes)")
    max_tokens: int = Field(default=16, ge=1)
    stream: bool = False
    model: str | None = None
    temperature: float | None = None  # accepted for compatibility; decoding is greedy


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(cfg: ReplicaConfig) -> FastAPI:
    torch.set_num_threads(1)  # many replicas share a few CPU cores
    spec = load_model(cfg.model)
    model = TinyGPT(spec, cfg.max_positions, cfg.seed)
    metrics = ReplicaMetrics(cfg.model)
    state: dict[str, Engine | asyncio.Task] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = Engine(model, metrics, max_running=cfg.max_running, max_waiting=cfg.max_waiting,
                        tokens_per_second=cfg.tokens_per_second)
        state["engine"], state["task"] = engine, asyncio.create_task(engine.run())
        yield
        state["task"].cancel()  # type: ignore[union-attr]

    app = FastAPI(title="elastic reference replica", lifespan=lifespan)
    app.state.metrics = metrics

    @app.get("/health")
    async def health() -> Response:
        task, engine = state.get("task"), state.get("engine")
        ok = isinstance(task, asyncio.Task) and not task.done() and not getattr(engine, "handing_off", False)
        return Response(status_code=200 if ok else 503)

    @app.post("/admin/handoff")
    async def handoff() -> Response:
        engine = state.get("engine")
        if not isinstance(engine, Engine):
            return _error(503, "engine not running", "unavailable")
        return JSONResponse({"handed_off": engine.handoff()})

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "elastic"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        engine = state.get("engine")
        if not isinstance(engine, Engine):
            return _error(503, "engine not running", "unavailable")
        if body.max_tokens > cfg.max_tokens_limit:
            return _error(400, f"max_tokens={body.max_tokens} exceeds this replica's limit {cfg.max_tokens_limit}",
                          "invalid_request_error")
        if isinstance(body.prompt, str):
            tokens = encode(body.prompt, spec.vocab)
        elif not body.prompt or any(not 0 <= t < spec.vocab for t in body.prompt):
            return _error(400, f"prompt: token ids must be a non-empty list of integers in [0, {spec.vocab}) "
                               f"(this model's vocabulary); send text or valid ids", "invalid_request_error")
        else:
            tokens = list(body.prompt)
        req = GenRequest(tokens, body.max_tokens)
        try:
            engine.submit(req)
        except QueueFull as e:
            return _error(429, str(e), "rate_limit_error")
        except Draining as e:
            return _error(503, str(e), "draining")
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_stream(req, cfg.model, created), media_type="text/event-stream")
        text = await _collect(req)
        return JSONResponse(_completion(req, cfg.model, created, text, "handoff" if req.handed_off else "length"))

    return app


async def _collect(req: GenRequest) -> str:
    parts = []
    try:
        while (piece := await req.out.get()) is not None:
            parts.append(piece)
    finally:
        req.cancelled = req.cancelled or (len(req.tokens) < req.max_tokens and not req.handed_off)
    return "".join(parts)


async def _stream(req: GenRequest, model: str, created: int) -> AsyncIterator[str]:
    try:
        while (piece := await req.out.get()) is not None:
            yield "data: " + json.dumps(_completion(req, model, created, piece, None)) + "\n\n"
        finish = "handoff" if req.handed_off else "length"
        yield "data: " + json.dumps(_completion(req, model, created, "", finish)) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # client went away mid-stream: free the slot
        req.cancelled = req.cancelled or (len(req.tokens) < req.max_tokens and not req.handed_off)


def _completion(req: GenRequest, model: str, created: int, text: str, finish: str | None) -> dict:
    out = {
        "id": f"cmpl-{req.id}", "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.tokens),
                  "total_tokens": len(req.prompt) + len(req.tokens)},
    }
    if finish == "handoff":  # where another replica picks it up (see POST /admin/handoff)
        out["resume"] = {"prompt": req.prompt + req.tokens, "max_tokens": req.max_tokens - len(req.tokens)}
    return out


# ---- running the server ---------------------------------------------------------------------------


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0 = a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"


def _server(cfg: ReplicaConfig) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(create_app(cfg), log_level="warning", access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=1))


def serve_forever(cfg: ReplicaConfig, sock: socket.socket) -> None:
    _server(cfg).run(sockets=[sock])


class ThreadedReplica:
    """A replica running in a background thread of this process (Ray actor, tests)."""

    def __init__(self, cfg: ReplicaConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = _server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"replica-{self.url}")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"reference replica at {self.url} did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def start_in_thread(cfg: ReplicaConfig, host: str = "127.0.0.1", port: int = 0) -> ThreadedReplica:
    return ThreadedReplica(cfg, host, port)
