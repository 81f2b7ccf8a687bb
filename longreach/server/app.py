"""`longreach serve`: the FastAPI app (routes, API key, error shapes) around one engine and its engine loop, on uvicorn.

Routes: POST /v1/completions, /v1/chat/completions (openai_api.py); POST|PUT /generate, POST /tokenize, /detokenize,
GET /tokenizer_info (native_api.py); GET /v1/models, /health, /health_generate, /metrics, /version, /get_model_info,
/server_info; POST /flush_cache. Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`; an
unexpected exception is logged with its traceback on the server and reaches the client as a bare 500 message.

Shutdown: on SIGTERM / SIGINT uvicorn stops accepting connections and waits for the open ones, so in-flight requests
(streams included) finish; then the engine loop stops and the process exits 0. A second signal forces the exit. If the
engine loop dies (an error out of the engine, engine_loop.py), `/health` answers 503 with the reason, the requests in
flight get their errors, uvicorn shuts down the same way and the process exits 1, for a supervisor to restart it.

Tensor parallelism (`--tensor-parallel-size N`): this process is rank 0 (HTTP, scheduler, sampler); its engine starts
the other ranks, or joins them under torchrun. A worker rank that dies kills the engine loop as above (`/health`: 503
naming the rank and its exit code); the engine is closed on the way out, so the worker processes end with the server.
`/metrics` and `/server_info` report rank 0's device and KV cache (every rank has as many KV pages).
"""
from __future__ import annotations

import hmac
import logging
import signal
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.heap import freeze_heap
from ..config import EngineConfig
from . import native_api, openai_api
from .config import ServerConfig
from .engine_loop import EngineLoop, PreparedPrompt
from .metrics import ServerMetrics, kv_cache_stats
from .state import ClientGone, ServerState
from .validation import APIError

logger = logging.getLogger("longreach")
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # reachable without the API key (probes, scrapers)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but OPEN_PATHS; 401 otherwise (constant-time comparison)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "incorrect API key"
                await _error(APIError(401, msg, code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"}))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        yield
        logger.info("stopping the engine loop")
        state.loop.stop()

    app = FastAPI(title="longreach", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if state.config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, e):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} is not allowed "
               f"on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(APIError(e.status_code, msg, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(APIError(500, "internal server error (the server log has the details)"))

    # ---- generation ----------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_api.create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_api.create_chat_completion(state, request)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return await native_api.generate(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await native_api.tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await native_api.detokenize(state, request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return native_api.tokenizer_info(state)

    # ---- introspection -------------------------------------------------------------------------------------------
    cfg = state.engine.config

    @app.get("/health")
    async def health():
        return health_response(state.loop)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """One greedy token from a one-token prompt through the running engine (SGLang's deep health check)."""
        from ..sampling_params import SamplingParams

        sub = state.submit([PreparedPrompt([0], None, SamplingParams(temperature=0, max_tokens=1))], False)
        await state.collect(sub, request)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [_model_card(state, name) for name in state.model_names]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        state.check_model(name)
        return JSONResponse(_model_card(state, name))

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__, "attention": cfg.attention, "preset": cfg.preset})

    @app.get("/get_model_info")
    async def get_model_info():
        return JSONResponse({"model_path": cfg.model, "tokenizer_path": cfg.model, "is_generation": True,
                             "served_model_name": state.model_name})

    @app.get("/server_info")
    async def server_info():
        engine_args = {k: getattr(cfg, k) for k in EngineConfig.field_names()}
        server_args = {k: getattr(state.config, k) for k in ServerConfig.field_names() if k != "api_key"}
        return JSONResponse({"version": __version__, "engine_args": engine_args, "server_args": server_args,
                             "device": str(state.engine.device), "device_name": _device_name(state.engine.device),
                             "dtype": str(state.engine.dtype).replace("torch.", ""),
                             **state.loop.snapshot()})

    @app.post("/flush_cache")
    async def flush_cache():
        return JSONResponse({"message": "nothing to flush: longreach keeps no prefix cache between requests"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _device_name(device) -> str:
    """The GPU's name for a CUDA device, else the device type ("cpu"): what a benchmark's provenance records."""
    if device.type != "cuda":
        return device.type
    import torch

    return torch.cuda.get_device_name(device)


def health_response(loop: EngineLoop) -> Response:
    """200 while the engine loop runs; 503 with an OpenAI error object saying why once it has died (the process
    then drains and exits 1) or while the server shuts down."""
    if loop.dead:
        return _error(APIError(503, f"the engine loop died ({loop.dead}); the server is draining and exits with "
                                    "status 1 so that its supervisor restarts it", code="engine_dead"))
    if not loop.alive:
        return _error(APIError(503, "the engine loop is not running: the server is shutting down",
                               code="shutting_down"))
    return Response(status_code=200)


def exit_status(started: bool, loop: EngineLoop) -> int:
    """The serve command's exit status: 0 after a clean shutdown; 1 if the server never started or its engine loop
    died (a supervisor restarts the process on a non-zero status)."""
    if loop.dead:
        logger.error("exiting with status 1: the engine loop died (%s)", loop.dead)
        return 1
    return 0 if started else 1


def _model_card(state: ServerState, name: str) -> dict:
    cfg = state.engine.config
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "longreach", "root": cfg.model,
            "parent": None, "max_model_len": cfg.max_model_len, "attention": cfg.attention, "preset": cfg.preset}


def make_state(engine, config: ServerConfig) -> ServerState:
    names = config.served_model_name or (engine.config.model,)
    metrics = ServerMetrics(names[0])
    return ServerState(engine, EngineLoop(engine, metrics, config.max_queued_requests), config, metrics, names)


def default_warmup_tokens(engine) -> int:
    """The warm-up request's prompt tokens where --warmup-tokens is not given (warm_up's docstring)."""
    if engine.device.type != "cuda":
        return 0
    return engine.warmup_prompt_tokens()


def warm_up(engine, tokens: int | None) -> None:
    """Run one untimed request through `engine` before the server listens, three times (twice where max_num_seqs is
    1 or 2): its prefill chunks (the first one and, past one chunk, one with a prefix) and a few decode steps, alone
    (whole-budget chunks: run 9's first 128K prompt alone compiled a sparse 8,192-token chunk's `_bsa_kernel` in its
    step), then with one short request and then up to 16 decoding beside its chunks (mixed steps, chunks of at most
    --long-prefill-token-threshold), compile the kernels the first clients would otherwise wait for; then the
    backend's graphs for every context length (`LLMEngine.capture_warm_graphs`).
    `tokens` None on a GPU: past the longest context the backend attends densely at (`warm_context`: a sparse
    method's `dense_below`, e.g. the trained context), one chunk + 1024, so that a whole chunk runs the method's own
    kernels (run 8 compiled a sparse 8,192-token chunk's kernels while serving: the warm-up's one sparse chunk had
    been its 1,024-token tail); at most max_model_len - 8; nothing on a CPU (0 skips both)."""
    from ..sampling_params import SamplingParams

    cfg = engine.config
    tokens = min(default_warmup_tokens(engine) if tokens is None else tokens, cfg.max_model_len - 8)
    if tokens <= 0:
        return
    t0 = time.perf_counter()
    vocab = engine.model_config.vocab_size
    ids = [100 + (i * 7919) % max(1, vocab - 100) for i in range(tokens)]  # ordinary ids, no special tokens
    # Mixed steps of 1 decode row, then of 16, 15, 14, ...: Triton specialises an integer argument on 1, on multiples
    # of 16 and on the rest (run 7's 1M server stalled 0.5-2.4 s in its first mixed steps with 16, 44 and 64 rows,
    # most likely compilations: docs/serving.md). The short requests go first and take a step, so that every chunk of
    # the long one, its first included, has them decoding beside it (a store that mixes no decode rows into prefill
    # steps, offloading, alternates the two kinds of step instead).
    for shorts in sorted({0, 1, min(16, cfg.max_num_seqs - 1)}):
        for i in range(shorts):  # in a batch, one more token each: the rows fall 16, 15, 14, ...
            engine.add_request(f"longreach-warmup-short-{i}", ids[:64 if shorts == 1 else 16], SamplingParams(
                temperature=0, max_tokens=16 if shorts == 1 else 2 + i, ignore_eos=True))
        if shorts:
            engine.step()
        engine.add_request("longreach-warmup", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    logger.info("warm-up: a request of %d prompt tokens alone and beside short ones in %.1f s (kernels compiled before "
                "listening; --warmup-tokens 0 skips it)", tokens, time.perf_counter() - t0)
    engine.capture_warm_graphs()


def serve(engine_config: EngineConfig, config: ServerConfig, verbose: bool = False) -> int:
    """Load the model, then serve until SIGTERM / SIGINT; returns the exit status. The engine is closed on the way
    out (tensor parallelism: its worker processes end)."""
    from ..engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config)  # with --tensor-parallel-size N: rank 0, the other ranks started (or joined)
    state = None
    try:
        state = make_state(engine, config)
        return _serve(engine, state, config, verbose, t0)
    finally:
        # the workers end with the server, whatever ended it: the stop plan when the engine thread is done (a
        # thread still inside a step, past stop()'s join, would never read it), terminated otherwise
        engine.close(stop=state is None or state.loop.finished)


def _serve(engine, state: ServerState, config: ServerConfig, verbose: bool, t0: float) -> int:
    import uvicorn

    warm_up(engine, config.warmup_tokens)
    freeze_heap()
    kv = kv_cache_stats(engine)
    logger.info("KV cache size: %d tokens", kv["gpu_pages_total"] * engine.config.block_size if not kv["offload"]
                else kv["host_pages_total"] * engine.config.block_size)
    logger.info("serving %s as %s with %s attention on %s (max_model_len %d), loaded in %.1f s; listening on "
                "http://%s:%d%s", engine.config.model, ", ".join(state.model_names), engine.config.attention,
                engine.device, engine.config.max_model_len, time.perf_counter() - t0, config.host, config.port,
                " (API key required)" if config.api_key else "")
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=config.host, port=config.port, log_config=None,
                                           access_log=verbose, timeout_graceful_shutdown=None))
    # a dead engine loop asks uvicorn to shut down as SIGTERM does: in-flight requests have their errors, so the
    # drain is quick; uvicorn polls the flag, so setting it from the engine thread is enough
    state.loop.on_dead = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it has drained; for SIGTERM that is the end of a clean
    # shutdown, so the re-raised one lands here and the process exits 0 (SIGINT keeps Python's KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: logger.info("drained; exiting"))
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return exit_status(server.started, state.loop)
