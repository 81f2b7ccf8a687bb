"""An OpenAI-compatible HTTP server over one LLMEngine (`longreach serve`); docs/serving.md describes it.

  command.py      `longreach serve`: its flags (the server's and the engine's) and the run that starts it
  config.py       ServerConfig: the serve-only flags
  validation.py   body -> JSON -> request model; every failure an OpenAI-shaped APIError (4xx)
  protocol.py     the request models per endpoint (strict pydantic), and their SamplingParams
  engine_loop.py  the one thread that steps the engine, admits and aborts requests between steps, streams deltas;
                  fails a request the engine failed alone, and dies loudly (503 /health, exit 1) if the engine breaks
  scoring_jobs.py logprobs of finished requests, scored one chunk per loop iteration between the engine's steps
  state.py        what every handler shares: tokenize off the event loop, submit, wait or stream, abort
  openai_api.py   /v1/completions, /v1/chat/completions
  native_api.py   SGLang's /generate; vLLM's /tokenize, /detokenize, /tokenizer_info
  metrics.py      Prometheus `longreach:` metrics and the periodic throughput log line
  app.py          the FastAPI app: routes, API key, error handlers, lifespan; `serve()` runs it on uvicorn

FastAPI, uvicorn and the Prometheus client come with the `[serve]` extra. command.py and config.py import none of
them, nor torch (the CLI builds its parser from them; it names the extra when one is missing); the engine is
created by `serve()`.
"""
