"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(...)`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence, Union

from ..config import EngineConfig
from ..progress import Progress
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .outputs import RequestOutput

PromptType = Union[str, dict, list]  # "text" | {"prompt": text} | {"prompt_token_ids": [...]} | [token ids]
LONG_PREFILL_TOKENS = 4096  # show prefill progress from this many prompt tokens on
_counter = itertools.count()


class LLM:
    """An engine instance holding one model. Keyword arguments are `EngineConfig` fields (the CLI flags)."""

    def __init__(self, model: str = "smollm2", **kwargs: Any):
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {sorted(unknown)}; valid: {', '.join(EngineConfig.field_names())}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.config = self.engine.config

    def close(self) -> None:
        """End what outlives this object: with tensor_parallel_size > 1, the worker processes. Idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- generate ------------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in the order of `prompts`."""
        items = self._normalise_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(items) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        encoded = [self._encode(i, p) for i, p in enumerate(items)]  # validate everything before queueing anything
        budget: dict[str, int] = {}  # request id -> the most tokens its decode steps can add (progress's total)
        limit = self.engine.config.max_model_len
        for (text, token_ids), sp in zip(encoded, params):
            rid = str(next(_counter))
            self.engine.add_request(rid, token_ids, sp, prompt=text)
            room = limit - len(token_ids)
            budget[rid] = sp.n * ((room if sp.max_tokens is None else min(sp.max_tokens, room)) - 1)  # 1: prefill's
        return self._run(budget, sum(len(t) * sp.n for (_, t), sp in zip(encoded, params)), use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered with the chat template."""
        tok = self._tokenizer_or_raise()
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": tok.encode(
                tok.apply_chat_template(conv, add_generation_prompt, **(chat_template_kwargs or {})),
                add_special_tokens=False)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _tokenizer_or_raise(self):
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
        return self.engine.tokenizer

    @staticmethod
    def _normalise_prompts(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [{"prompt_token_ids": list(prompts)}]  # a single token-id prompt
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a {'prompt': ...} / {'prompt_token_ids': [...]} dict, "
                             "or a non-empty list of them")
        return list(prompts)

    def _encode(self, i: int, p) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            text, token_ids = p, None
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            text, token_ids = p.get("prompt"), list(p["prompt_token_ids"])
        elif isinstance(p, dict) and "prompt" in p:
            text, token_ids = p["prompt"], None
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            text, token_ids = None, list(p)
        else:
            raise ValueError(f"prompt {i} must be a string, a dict with 'prompt' or 'prompt_token_ids', "
                             f"or a list of token ids; got {type(p).__name__}")
        if token_ids is None:
            if not isinstance(text, str) or not text:
                raise ValueError(f"prompt {i} is empty: give some text")
            token_ids = self._tokenizer_or_raise().encode(text)
        self.engine.check_prompt(token_ids, f"prompt {i}")  # every prompt is checked before any is queued
        return text, token_ids

    def _run(self, budget: dict[str, int], prompt_tokens: int, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request finishes. With `use_tqdm`, progress goes to stderr (progress.py: a
        bar on a terminal, periodic lines in a log): prefill tokens on long prompts, then generated tokens.
        `budget`: request id -> the most tokens its decode steps can add (each sequence's first token comes with
        its prefill)."""
        engine = self.engine
        request_ids = list(budget)
        done: dict[str, RequestOutput] = {}
        prefill = Progress(prompt_tokens, "prefill", enabled=use_tqdm and prompt_tokens >= LONG_PREFILL_TOKENS,
                           leave=False).follow_layers(engine.model, engine.device)
        decode = None  # made at the first decode step, so that its rate and ETA count decode time only
        left = sum(budget.values())  # tokens still possible; a request that stops early (EOS, stop string) lowers it
        try:
            while engine.has_unfinished_requests():
                finished = engine.step()
                st = engine.last_step
                if st is not None:
                    prompt = st.num_tokens - st.num_decode_tokens  # a mixed step has both
                    prefill.update(min(prompt, prefill.total - prefill.n))
                    if st.is_prefill and prefill.n >= prefill.total:
                        prefill.close()
                    if st.num_decode_tokens:
                        if decode is None:
                            decode = Progress(left, "decode", enabled=use_tqdm)
                        decode.update(st.num_decode_tokens)
                for out in finished:
                    done[out.request_id] = out
                    left -= budget[out.request_id] - sum(max(len(c.token_ids) - 1, 0) for c in out.outputs)
                    if decode is not None:
                        decode.set_total(left)
                if decode is not None and len(request_ids) > 1:
                    decode.set_postfix(f"{len(done)}/{len(request_ids)} requests done")
        except BaseException:
            for rid in request_ids:  # leave the engine clean for the next call
                engine.abort_request(rid)
            raise
        finally:
            prefill.close()
            if decode is not None:
                decode.close()
        return [done[r] for r in request_ids]
