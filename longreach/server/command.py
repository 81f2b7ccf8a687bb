"""`longreach serve`: its flags (the server's beside the engine's) and the run that starts the server."""
from __future__ import annotations

from ..commands.engine_args import add_engine_args, engine_config_from_args
from ..config import EngineConfig
from .config import add_server_args, server_config_from_args

HELP = "an OpenAI-compatible HTTP server (continuous batching, streaming, metrics)"
DESCRIPTION = ("Serve a model over HTTP: OpenAI's /v1/completions and /v1/chat/completions, SGLang's /generate, "
               "/tokenize, /metrics and more (docs/serving.md). Engine flags mean what they mean for "
               "`longreach generate`. SIGTERM drains the requests in flight, then exits.")


def add_arguments(p) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="model: an alias (smollm2), a HF model directory or a .gguf file (same as --model)")
    add_server_args(p)
    add_engine_args(p)


def main(args) -> int:
    if args.model_arg is not None:
        if args.model != EngineConfig.model and args.model != args.model_arg:
            raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}; give one")
        args.model = args.model_arg
    server_config = server_config_from_args(args)
    engine_config = engine_config_from_args(args)
    from ..engine.llm_engine import LLMEngine
    from ..engine.tp_workers import serve_if_worker

    serve_if_worker(engine_config, LLMEngine)  # under torchrun, ranks > 0 run rank 0's steps and end here; rank 0 serves HTTP
    from .app import serve

    return serve(engine_config, server_config, verbose=args.verbose)
