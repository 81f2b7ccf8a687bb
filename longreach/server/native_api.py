"""The non-OpenAI routes clients probe: SGLang's `/generate` and vLLM's tokenizer endpoints.

`POST`/`PUT /generate` (SGLang): `{"text" | "input_ids", "sampling_params": {max_new_tokens, temperature, top_p, top_k,
min_p, stop, stop_token_ids, ignore_eos, n, ...}, "stream"}` -> `{"text", "output_ids", "meta_info"}`, a list for a
batch or n > 1; streamed as SSE chunks carrying the text so far (SGLang's default), then `data: [DONE]`. RULER's
`--server_type sglang` client sends exactly this (PUT).

`/tokenize`, `/detokenize`, `/tokenizer_info` (vLLM): token ids of a prompt or of chat messages rendered with the
template, the text of token ids, and the tokenizer's settings.
"""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from .engine_loop import PreparedPrompt, Update
from .protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest, message_dicts
from .state import ServerState
from .validation import bad_request, read_json, validate


def _finish_reason(reason: str | None, stop_reason, token_ids: list[int]) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(token_ids)}
    matched = stop_reason if stop_reason is not None else (token_ids[-1] if token_ids else None)  # EOS: its id
    return {"type": reason, "matched": matched}


async def generate(state: ServerState, request):
    req: GenerateRequest = validate(GenerateRequest, await read_json(request, state.config.max_request_bytes))
    items, batch = req.prompts()
    params = req.params(len(items))
    rids = req.request_ids(len(items))

    def prepare() -> list[PreparedPrompt]:
        out = []
        for i, (p, sp) in enumerate(zip(items, params)):
            param = ("text" if isinstance(p, str) else "input_ids") + (f"[{i}]" if batch else "")
            ids = state.encode(p, True, param) if isinstance(p, str) else list(p)
            state.check_prompt(ids, sp.max_tokens, param)
            out.append(PreparedPrompt(ids, p if isinstance(p, str) else None, sp))
        return out

    prompts = await state.in_thread(prepare)
    sub = state.submit(prompts, req.stream)
    ids = rids or sub.request_ids

    def meta(slot: int, k: int, token_ids: list[int], reason, stop_reason) -> dict:
        return {"id": ids[slot] if params[slot].n == 1 else f"{ids[slot]}-{k}",
                "finish_reason": _finish_reason(reason, stop_reason, token_ids),
                "prompt_tokens": len(prompts[slot].token_ids), "completion_tokens": len(token_ids),
                "cached_tokens": 0, "e2e_latency": time.perf_counter() - sub.arrival}

    # one flat output per (prompt, sample), SGLang's order
    flat = [(slot, k) for slot in range(len(prompts)) for k in range(params[slot].n)]
    single = len(flat) == 1
    if not req.stream:
        finals = await state.collect(sub, request)
        outs = []
        for slot, k in flat:
            c = finals[slot].output.outputs[k]
            outs.append({"text": c.text, "output_ids": c.token_ids,
                         "meta_info": meta(slot, k, c.token_ids, c.finish_reason, c.stop_reason)})
        return JSONResponse(outs[0] if single else outs)

    text = {key: "" for key in flat}
    tokens: dict[tuple[int, int], list[int]] = {key: [] for key in flat}
    position = {key: i for i, key in enumerate(flat)}

    def render(upd: Update) -> list[dict]:
        chunks = []
        for d in upd.deltas:
            key = (upd.slot, d.index)
            text[key] += d.text
            tokens[key] += d.token_ids
            chunk = {"text": text[key], "output_ids": list(tokens[key]),
                     "meta_info": meta(upd.slot, d.index, tokens[key], d.finish_reason, d.stop_reason)}
            if not single:
                chunk["index"] = position[key]
            chunks.append(chunk)
        return chunks

    return state.stream(sub, render)


async def tokenize(state: ServerState, request):
    req: TokenizeRequest = validate(TokenizeRequest, await read_json(request, state.config.max_request_bytes))
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")

    def run() -> list[int]:
        if req.prompt is not None:
            return state.encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens,
                                "prompt")
        text = state.render_chat(message_dicts(req.messages), req.add_generation_prompt, req.chat_template_kwargs)
        return state.encode(text, bool(req.add_special_tokens), "messages")

    ids = await state.in_thread(run)
    body = {"count": len(ids), "max_model_len": state.engine.config.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = [state.tokenizer.backend.id_to_token(t) for t in ids]
    return JSONResponse(body)


async def detokenize(state: ServerState, request):
    req: DetokenizeRequest = validate(DetokenizeRequest, await read_json(request, state.config.max_request_bytes))
    state.check_model(req.model)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'tokens' must be ids in [0, {vocab}), got {bad[0]}", param="tokens")
    text = await state.in_thread(lambda: state.tokenizer.decode(req.tokens))
    return JSONResponse({"prompt": text})


def tokenizer_info(state: ServerState) -> JSONResponse:
    tok = state.tokenizer
    return JSONResponse({"tokenizer_class": type(tok.backend).__name__, "vocab_size": tok.vocab_size,
                         "model_max_length": state.engine.config.max_model_len, "bos_token": tok.bos_token,
                         "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
                         "eos_token_id": tok.eos_token_id, "chat_template": tok.chat_template})
