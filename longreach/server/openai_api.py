"""`POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's shapes as vLLM serves them.

Completions take a string, a list of strings, a list of token ids or a list of those; choice i*n + j is sample j of
prompt i. `echo` prepends the prompt; `logprobs` (with `echo`, over the prompt too, as lm-eval's `local-completions`
asks for loglikelihoods) gives tokens, token_logprobs, top_logprobs and text_offset. Chat renders `messages` with the
model's chat template. `stream` sends SSE chunks (`text_completion` / `chat.completion.chunk`) and `data: [DONE]`;
`stream_options.include_usage` adds a last chunk with the usage and no choices. vLLM's extras (top_k, min_p,
min_tokens, stop_token_ids, ignore_eos, return_token_ids, ...) are accepted.
"""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from .engine_loop import PreparedPrompt, ScoredSample, Update
from .protocol import ChatRequest, CompletionRequest, message_dicts
from .state import ServerState, new_id
from .validation import read_json, validate

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions; chat: the rest of the context


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---- /v1/completions -------------------------------------------------------------------------------------------------
async def create_completion(state: ServerState, request):
    req: CompletionRequest = validate(CompletionRequest, await read_json(request, state.config.max_request_bytes))
    state.check_model(req.model)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(max_tokens)

    def prepare() -> list[PreparedPrompt]:
        out = []
        for i, p in enumerate(req.prompt):
            param = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
            ids = state.encode(p, req.add_special_tokens, param) if isinstance(p, str) else list(p)
            state.check_prompt(ids, max_tokens, param)
            out.append(PreparedPrompt(ids, p if isinstance(p, str) else None, params, req.logprobs,
                                      0 if req.echo else len(ids)))
        return out

    prompts = await state.in_thread(prepare)
    sub = state.submit(prompts, req.stream)
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if not req.stream:
        finals = await state.collect(sub, request)

        def choices() -> list[dict]:
            out = []
            for slot, (p, upd) in enumerate(zip(prompts, finals)):
                for c in upd.output.outputs:
                    echo = _prompt_text(state, p) if req.echo else ""
                    choice = {"index": slot * req.n + c.index, "text": echo + c.text, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.logprobs is not None:
                        choice["logprobs"] = _completion_logprobs(state, p, c.token_ids, upd.scored[c.index],
                                                                  req.echo)
                    if req.return_token_ids:
                        choice.update(prompt_token_ids=p.token_ids, token_ids=c.token_ids)
                    out.append(choice)
            return out

        n_out = sum(len(c.token_ids) for upd in finals for c in upd.output.outputs)
        usage = _usage(sum(len(p.token_ids) for p in prompts), n_out)
        return JSONResponse({**head, "choices": await state.in_thread(choices), "usage": usage})

    counts = {"out": 0}
    started: set[int] = set()
    opts = req.stream_options
    prompt_tokens = sum(len(p.token_ids) for p in prompts)

    def render(upd: Update) -> list[dict]:
        chunks = []
        for d in upd.deltas:
            index = upd.slot * req.n + d.index
            text = d.text
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": d.finish_reason,
                      "stop_reason": d.stop_reason}
            if index not in started:
                started.add(index)
                if req.echo:
                    choice["text"] = _prompt_text(state, prompts[upd.slot]) + text
                if req.return_token_ids:
                    choice["prompt_token_ids"] = prompts[upd.slot].token_ids
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            counts["out"] += len(d.token_ids)
            chunk = {**head, "choices": [choice]}
            if opts is not None and opts.continuous_usage_stats:
                chunk["usage"] = _usage(prompt_tokens, counts["out"])
            chunks.append(chunk)
        return chunks

    def finish() -> list[dict]:
        if opts is not None and opts.include_usage:
            return [{**head, "choices": [], "usage": _usage(prompt_tokens, counts["out"])}]
        return []

    return state.stream(sub, render, finish)


def _prompt_text(state: ServerState, p: PreparedPrompt) -> str:
    return p.text if p.text is not None else state.tokenizer.decode(p.token_ids, skip_special_tokens=False)


def _completion_logprobs(state: ServerState, p: PreparedPrompt, output_ids: list[int], scored: ScoredSample,
                         echo: bool) -> dict:
    """OpenAI's legacy logprobs object over the returned text: the prompt's tokens too with `echo` (the first has no
    logprob), then the generated ones. text_offset is each token's start in the returned `text`."""
    ids = p.token_ids + output_ids
    first = 0 if echo else len(p.token_ids)
    tokens, token_lps, tops, offsets, at = [], [], [], [], 0
    for pos in range(first, len(ids)):
        s = state.token_str(ids[pos])
        tokens.append(s)
        offsets.append(at)
        at += len(s)
        if pos < scored.start:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(scored.logprobs[pos - scored.start])
            tops.append({state.token_str(t): lp for t, lp in scored.top[pos - scored.start]})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# ---- /v1/chat/completions --------------------------------------------------------------------------------------------
async def create_chat_completion(state: ServerState, request):
    req: ChatRequest = validate(ChatRequest, await read_json(request, state.config.max_request_bytes))
    state.check_model(req.model)
    max_tokens = req.max_new_tokens
    params = req.sampling_params(max_tokens)
    messages = message_dicts(req.messages)

    def prepare() -> list[PreparedPrompt]:
        text = state.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = state.encode(text, False, "messages")
        state.check_prompt(ids, max_tokens, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        return [PreparedPrompt(ids, text, params, top, len(ids))]

    prompts = await state.in_thread(prepare)
    sub = state.submit(prompts, req.stream)
    rid, created = new_id("chatcmpl"), int(time.time())
    p = prompts[0]
    if not req.stream:
        upd = (await state.collect(sub, request))[0]
        choices = []
        for c in upd.output.outputs:
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.logprobs:
                scored = upd.scored[c.index]
                choice["logprobs"] = {"content": _chat_logprobs(state, c.token_ids, scored, len(p.token_ids))}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        n_out = sum(len(c.token_ids) for c in upd.output.outputs)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": _usage(len(p.token_ids), n_out)}
        if req.return_token_ids:
            body["prompt_token_ids"] = p.token_ids
        return JSONResponse(body)

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    counts = {"out": 0}
    opts = req.stream_options

    def chunk(choices: list[dict]) -> dict:
        out = {**head, "choices": choices}
        if opts is not None and opts.continuous_usage_stats:
            out["usage"] = _usage(len(p.token_ids), counts["out"])
        return out

    def render(upd: Update) -> list[dict]:
        chunks = []
        for d in upd.deltas:
            counts["out"] += len(d.token_ids)
            choice = {"index": d.index, "delta": {"content": d.text} if d.text or not d.finish_reason else {},
                      "logprobs": None, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            chunks.append(chunk([choice]))
        return chunks

    def finish() -> list[dict]:
        if opts is not None and opts.include_usage:
            return [{**head, "choices": [], "usage": _usage(len(p.token_ids), counts["out"])}]
        return []

    # OpenAI's first chunk carries the role, before any token (and before a long prefill ends)
    role = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(req.n)]
    return state.stream(sub, render, finish, first=[chunk(role)])


def _chat_logprobs(state: ServerState, output_ids: list[int], scored: ScoredSample, prompt_len: int) -> list[dict]:
    def entry(token_id: int, lp: float) -> dict:
        s = state.token_str(token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    out = []
    for k, tok in enumerate(output_ids):
        pos = prompt_len + k - scored.start
        out.append({**entry(tok, scored.logprobs[pos]), "top_logprobs": [entry(t, lp) for t, lp in scored.top[pos]]})
    return out
