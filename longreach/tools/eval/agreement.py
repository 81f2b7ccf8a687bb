"""Does a sparse method change what the model writes? Greedy continuations of a long prompt, method vs dense."""
from __future__ import annotations

import gc
import time


def run(model: str, text: str, length: int, new_tokens: int, methods: list, attention_config: dict | str | None,
        device: str, dtype: str) -> dict:
    """Prompt = the first `length - new_tokens` tokens of `text`; each method (`common.RunSpec`) generates
    `new_tokens` greedily."""
    from ...sampling_params import SamplingParams
    from .common import eval_config, make_llm, parse_methods

    attention_config = eval_config(attention_config)  # a dict (JSON text from a Python caller: parsed once, here)
    if new_tokens < 1 or new_tokens >= length:
        raise ValueError(f"--new-tokens must be in [1, --length), got {new_tokens}")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    report: dict = {"length": length, "new_tokens": new_tokens, "methods": {}}
    runs = parse_methods(["dense"]) + [m for m in methods if m.name != "dense"]
    prompt = None
    reference = None
    for spec in runs:
        llm = make_llm(model, spec, attention_config, device, dtype, length, max_num_seqs=1)
        if prompt is None:
            ids = llm.get_tokenizer().encode(text)
            if len(ids) < length:
                raise ValueError(f"the text has {len(ids)} tokens, fewer than --length {length}")
            prompt = ids[: length - new_tokens]
            report.update(model=llm.engine.model_config.name, device=str(llm.engine.device),
                          dtype=str(llm.engine.dtype).replace("torch.", ""))
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        row = {"seconds": round(time.perf_counter() - t0, 2), "text": out.text}
        if reference is None:
            reference = out.token_ids
        else:
            same = [a == b for a, b in zip(out.token_ids, reference)]
            row.update(tokens_equal=sum(same), first_difference=next((i for i, s in enumerate(same) if not s), None))
        report["methods"][spec.label] = row
        del llm
        gc.collect()
    return report
