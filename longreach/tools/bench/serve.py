"""`longreach bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does, and time it.

N requests from a synthetic dataset go to /v1/completions (token-id prompts, exact lengths) or /v1/chat/completions
(the same ids detokenized into a user message), all streamed with `stream_options.include_usage`, at
`--request-rate` (Poisson arrivals; inf sends them all at once) and with at most `--max-concurrency` in flight. Lengths
are uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]; `--long-prompts K --long-input-len L` makes K of the
N prompts L tokens long, spread evenly over the run (the mixed load: a few long prefills among short chats).

`--duration S` keeps sending for S seconds, cycling through the short requests (a soak test; long ones go once), and
`--sample-metrics S` reads the server's /metrics every S seconds (its memory over the run).

Reported (ms, mean / median / p99 / max): TTFT (request sent -> first token), TPOT ((E2EL - TTFT) / (output tokens -
1)), ITL (between streamed chunks, one per engine step: on /v1/completions the request asks for `return_token_ids`, so
a token that decodes to no text still marks its chunk; on chat, a chunk without content is not seen), E2EL; request and token throughput; failures. With long
prompts, the same for the short requests alone, the long ones alone, and the short ones whose life overlapped a long
prompt's prefill (what a user of a shared server feels while someone else's 128K prompt is being read), and every gap
a short request saw while a long prompt was prefilled (serve_report.py). Printed as a table and written as JSON (with
one record per request).

The client is asyncio streams speaking HTTP/1.1 (one connection per request, chunked SSE parsed as it arrives): no
dependency, and the timestamps are taken when the bytes arrive.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field

from .serve_report import format_table, parse_gauges, report

HELP = "load an OpenAI-compatible server (longreach serve, vLLM, SGLang) and report TTFT / TPOT / ITL / E2EL"


@dataclass
class RequestSpec:
    prompt_ids: list[int]
    output_len: int
    group: str  # "short" | "long"


@dataclass
class RequestResult:
    group: str
    input_len: int
    output_len: int = 0  # generated tokens (the usage chunk's count; else streamed chunks)
    prompt_tokens: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the run started
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # each streamed chunk, seconds since the run started

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.success and self.output_len > 1 else None


# ---- dataset ---------------------------------------------------------------------------------------------------------
def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))))


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int,
                   long_prompts: int = 0, long_input_len: int = 0) -> list[RequestSpec]:
    """`n` requests of random token ids (from [100, vocab), clear of most special tokens); `long_prompts` of them,
    spread evenly, `long_input_len` tokens long."""
    rng = random.Random(seed)
    long_at = {min(n - 1, int((j + 0.5) * n / long_prompts)) for j in range(long_prompts)} if long_prompts else set()
    low = min(100, vocab_size - 1)
    specs = []
    for i in range(n):
        long = i in long_at
        m = long_input_len if long else _length(rng, input_len, range_ratio)
        specs.append(RequestSpec([rng.randrange(low, vocab_size) for _ in range(m)],
                                 _length(rng, output_len, range_ratio), "long" if long else "short"))
    return specs


# ---- HTTP/1.1 + SSE over asyncio streams ----------------------------------------------------------------------------
class Endpoint:
    def __init__(self, base_url: str, api_key: str | None):
        u = urllib.parse.urlsplit(base_url if "://" in base_url else "http://" + base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"--base-url must be http:// or https://, got {base_url!r}")
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.api_key = api_key

    async def request(self, method: str, path: str, body: dict | None = None, on_event=None) -> tuple[int, bytes]:
        """Send one request; with `on_event`, call it with each SSE `data:` payload as it arrives. -> (status, body
        bytes not consumed as events)."""
        ctx = ssl.create_default_context() if self.tls else None
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=ctx)
        try:
            data = json.dumps(body).encode() if body is not None else b""
            head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close",
                    "Content-Type: application/json", f"Content-Length: {len(data)}", "Accept: text/event-stream"]
            if self.api_key:
                head.append(f"Authorization: Bearer {self.api_key}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            rest = bytearray()
            buf = bytearray()

            def feed(chunk: bytes) -> None:
                if on_event is None or status != 200:
                    rest.extend(chunk)
                    return
                buf.extend(chunk)
                while (i := buf.find(b"\n\n")) >= 0:
                    event, buf[:] = bytes(buf[:i]), buf[i + 2:]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            on_event(line[5:].strip())

            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        break
                    feed(await reader.readexactly(size))
                    await reader.readexactly(2)
            elif "content-length" in headers:
                feed(await reader.readexactly(int(headers["content-length"])))
            else:
                while chunk := await reader.read(65536):
                    feed(chunk)
            return status, bytes(rest)
        finally:
            writer.close()

    async def get_json(self, path: str) -> dict:
        status, body = await self.request("GET", path)
        if status != 200:
            raise ValueError(f"GET {path} answered {status}: {body[:200]!r}")
        return json.loads(body)


# ---- one request -----------------------------------------------------------------------------------------------------
async def _run_one(ep: Endpoint, chat: bool, model: str, spec: RequestSpec, prompt_text: str | None, t_run: float,
                   ignore_eos: bool, timeout: float) -> RequestResult:
    res = RequestResult(spec.group, len(spec.prompt_ids))
    body = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt_text}]
    else:  # token ids in every chunk: a token that decodes to no text (yet) still marks its step (its ITL)
        body["prompt"], body["return_token_ids"] = spec.prompt_ids, True
    chunks: list[float] = []
    state = {"usage": None, "error": None}

    def on_event(payload: bytes) -> None:
        if payload == b"[DONE]":
            return
        now = time.perf_counter()
        obj = json.loads(payload)
        if "error" in obj:
            state["error"] = obj["error"].get("message", str(obj["error"]))
            return
        if obj.get("usage"):
            state["usage"] = obj["usage"]
        for c in obj.get("choices", []):
            piece = c.get("delta", {}).get("content") if chat else c.get("text")
            if piece or c.get("token_ids"):
                chunks.append(now)

    t0 = time.perf_counter()
    res.start = t0 - t_run
    try:
        status, rest = await asyncio.wait_for(ep.request("POST", "/v1/chat/completions" if chat else
                                                         "/v1/completions", body, on_event), timeout)
    except (OSError, asyncio.TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    if status != 200:
        res.error = f"HTTP {status}: {rest[:200].decode(errors='replace')}"
    elif state["error"] or not chunks:
        res.error = state["error"] or "no tokens streamed"
    if res.error:
        return res
    res.success = True
    res.ttft, res.e2el = chunks[0] - t0, end - t0
    res.itl = [b - a for a, b in itertools.pairwise(chunks)]
    res.token_times = [c - t_run for c in chunks]
    usage = state["usage"] or {}
    res.output_len = usage.get("completion_tokens", len(chunks))
    res.prompt_tokens = usage.get("prompt_tokens", len(spec.prompt_ids))
    return res


# ---- the run ---------------------------------------------------------------------------------------------------------
async def run_benchmark(base_url: str, specs: list[RequestSpec], *, chat: bool = False, model: str | None = None,
                        request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                        ignore_eos: bool = True, api_key: str | None = None, timeout: float = 3600.0,
                        duration: float | None = None, sample_every: float | None = None) -> dict:
    """Send `specs` (once; with `duration`, the short ones cycled until `duration` seconds have passed, then the ones
    in flight are awaited) and report (serve_report.py). With `sample_every`, /metrics is read every that many seconds."""
    ep = Endpoint(base_url, api_key)
    models = await ep.get_json("/v1/models")
    model = model or models["data"][0]["id"]
    try:
        version = await ep.get_json("/version")
    except (ValueError, OSError):
        version = {}
    texts: list[str | None] = [None] * len(specs)
    if chat:  # detokenize outside the timed run
        for i, s in enumerate(specs):
            status, body = await ep.request("POST", "/detokenize", {"model": model, "tokens": s.prompt_ids})
            if status != 200:
                raise ValueError(f"POST /detokenize answered {status}: {body[:200]!r}")
            texts[i] = json.loads(body)["prompt"]
    probe = await _run_one(ep, chat, model, RequestSpec(specs[0].prompt_ids[:16], 2, "probe"), (texts[0] or "")[:64],
                           time.perf_counter(), ignore_eos, 600.0)
    if not probe.success:
        raise ValueError(f"the first test request failed: {probe.error}")

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t_run = time.perf_counter()

    async def one(spec, text, holding: bool = False):
        if limit is None:
            return await _run_one(ep, chat, model, spec, text, t_run, ignore_eos, timeout)
        if holding:  # the place was taken before the task started (a closed loop)
            try:
                return await _run_one(ep, chat, model, spec, text, t_run, ignore_eos, timeout)
            finally:
                limit.release()
        async with limit:
            return await _run_one(ep, chat, model, spec, text, t_run, ignore_eos, timeout)

    samples: list[dict] = []
    sampler = asyncio.create_task(_sample(ep, t_run, sample_every, samples)) if sample_every else None
    tasks = []
    order = zip(specs, texts)
    if duration:  # the long prompts go once (in the first pass), the short ones cycle
        order = itertools.chain(order, itertools.cycle([(s, t) for s, t in zip(specs, texts) if s.group != "long"]))
    for spec, text in order:
        if duration and time.perf_counter() - t_run >= duration:
            break
        if duration and limit is not None and request_rate == math.inf:
            await limit.acquire()  # closed loop: the next request goes when a place frees
            tasks.append(asyncio.create_task(one(spec, text, holding=True)))
        else:
            tasks.append(asyncio.create_task(one(spec, text)))
        if request_rate != math.inf:
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t_run
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return report(results, elapsed, {
        "base_url": base_url, "endpoint": "/v1/chat/completions" if chat else "/v1/completions", "model": model,
        "server_version": version, "num_prompts": len(results), "request_rate": request_rate,
        "max_concurrency": max_concurrency, "ignore_eos": ignore_eos, "seed": seed, "send_for_s": duration},
        samples if sample_every else None)


async def _sample(ep: Endpoint, t_run: float, every: float, into: list[dict]) -> None:
    """Append the server's gauges (serve_report.GAUGES) every `every` seconds until cancelled; a failed read is
    recorded as such (the server may be busy or gone: that is worth seeing)."""
    while True:
        t = time.perf_counter() - t_run
        try:
            status, body = await asyncio.wait_for(ep.request("GET", "/metrics"), max(every, 1.0))
            into.append({"t": t, **parse_gauges(body.decode(errors="replace"))} if status == 200
                        else {"t": t, "error": f"HTTP {status}"})
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            into.append({"t": t, "error": f"{type(e).__name__}: {e}"})
        await asyncio.sleep(every)


# ---- CLI -------------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions with token-id prompts (exact lengths) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default: 1024)")
    p.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - r, 1 + r] (default: 0, fixed)")
    p.add_argument("--long-prompts", type=int, default=0, help="how many of the prompts are long (default: 0)")
    p.add_argument("--long-input-len", type=int, default=131072, help="tokens of a long prompt (default: 131072)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (vLLM's ignore_eos; default: on)")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default: 0)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take (default: 3600)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $LONGREACH_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="keep sending for S seconds, cycling through the short requests (the long ones go once), then "
                        "wait for those in flight (a soak test; needs --max-concurrency or --request-rate)")
    p.add_argument("--sample-metrics", type=float, default=None, metavar="S",
                   help="read the server's /metrics every S seconds: running / waiting requests, KV usage, process "
                        "RSS and GPU memory over the run, and their first / last / max (default: off)")
    p.add_argument("--out", default="bench-serve.json", help="JSON output path (default: bench-serve.json)")


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not 0 <= args.long_prompts <= args.num_prompts or args.long_input_len < 1:
        raise ValueError("--long-prompts must be in [0, --num-prompts] and --long-input-len >= 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate must be > 0 and --max-concurrency >= 1")
    if args.duration is not None and (args.duration <= 0 or (args.max_concurrency is None
                                                              and args.request_rate == math.inf)):
        raise ValueError(f"--duration must be > 0 seconds and needs --max-concurrency or a finite --request-rate "
                         f"(else every request would go at once, forever); got --duration {args.duration}")
    if args.sample_metrics is not None and args.sample_metrics <= 0:
        raise ValueError(f"--sample-metrics must be > 0 seconds, got {args.sample_metrics}")
    key = args.api_key or os.environ.get("LONGREACH_API_KEY") or os.environ.get("OPENAI_API_KEY")
    rep = asyncio.run(_main(args, key))
    print(format_table(rep))
    from ..report import write_json

    write_json(rep, args.out)
    print(f"[longreach] wrote {args.out}")
    return 0 if rep["groups"]["all"]["failed"] == 0 else 1


async def _main(args: argparse.Namespace, key: str | None) -> dict:
    ep = Endpoint(args.base_url, key)
    try:
        info = await ep.get_json("/tokenizer_info")
        vocab = int(info["vocab_size"])
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"cannot read the vocabulary size from {args.base_url}/tokenizer_info: {e}") from None
    specs = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           vocab, args.seed, args.long_prompts, args.long_input_len)
    rep = await run_benchmark(args.base_url, specs, chat=args.endpoint == "chat", model=args.model,
                              request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                              ignore_eos=args.ignore_eos, api_key=key, timeout=args.timeout,
                              duration=args.duration, sample_every=args.sample_metrics)
    return {"provenance": await _provenance(ep, args, rep["num_prompts"]), **rep}


async def _provenance(ep: Endpoint, args: argparse.Namespace, n_sent: int) -> dict:
    """tools/report.py's record, the device and attention being the server's (its /server_info, where it has one:
    longreach and SGLang do; "unknown" otherwise). The server's preset is as it was given: None means the method's
    default at the server's commit. `commit` is this client's tree, which is the server's when both run from it."""
    from ..report import command_line, provenance, samples

    try:
        info = await ep.get_json("/server_info")
    except (ValueError, OSError):
        info = {}
    engine = info.get("engine_args") or {}
    attention = [{"label": engine["attention"] + (f":{engine['preset']}" if engine.get("preset") else ""),
                  "method": engine["attention"], "preset": engine.get("preset"),
                  "attention_config": engine.get("attention_config")}] if engine.get("attention") else None
    return provenance(command_line(args), info.get("device_name") or "unknown (the server did not say)",
                      attention=attention, samples=samples(n_sent, "run", "requests (a 16-token probe "
                                                                                    "request before the timed run "
                                                                                    "is left out)"))
