"""Tokenizer: a `tokenizers.Tokenizer` plus the model's chat template and special tokens.

Built from a HF directory (tokenizer.json + tokenizer_config.json [+ chat_template.jinja]) or from GGUF metadata
(models/gguf.py). Chat templates are rendered with Jinja2 in a sandbox, with the variables transformers passes
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation (list of {"role", "content"} dicts) to the prompt text the model was tuned on."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt instead of chat()")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"{path} has no tokenizer.json (longreach needs a fast-tokenizer file)")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        return cls(backend, chat_template=template, bos_token=_token_str(cfg.get("bos_token")),
                   eos_token=_token_str(cfg.get("eos_token")))


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDecoder:
    """Turns a growing list of output ids into text, one step at a time, without re-decoding the whole output.

    `push(id)` returns the new text (possibly "" while a multi-byte character is incomplete).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tk = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tk, token_id) or ""
