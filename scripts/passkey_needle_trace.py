"""Experiment (docs/quality.md, "Passkey"): in which layer and pruning stage does infinitehip's selection for the
prompt's last row lose the pass key?

Runs the engine's real prefill on passkey prompts: kernels on a GPU, the RoPE strategies, the default config or the
JSON overrides given. For the last query block it records the output of every pruning stage in every sparse layer.
That block is the prompt's last row, which predicts the answer. Then it generates the answer.

For each layer it prints one character, the best over the layer's selection groups:
  K   the last stage's blocks cover every token of the key's digits
  k   they cover some of them
  0/1/2...  the first stage after which no digit token is covered any more
  w   the digits lie in the window (read without selection)
and it writes the per-group detail as JSON.

  python scripts/passkey_needle_trace.py MODEL LENGTH[,LENGTH...] DEPTH[,DEPTH...] OUT.json [CONFIG_JSON]
  (environment: PRESET=3k-box, HAYSTACK=filler|paul-graham|squad, NEEDLE=classic|secret|code, KV_GB=20, MBT=32768)
"""
import json
import os
import sys
import time

from longreach.engine.llm import LLM
from longreach.sampling_params import SamplingParams
from longreach.tools.eval.passkey import NEEDLES, passkey_prompt, score
from longreach.tools.eval.presets import register


def digit_positions(tok, prompt: list[int], key: str, phrasing: str) -> list[int]:
    """Positions in `prompt` of the needle's tokens that carry the key's digits."""
    needle = tok.encode(" " + NEEDLES[phrasing][0].format(key=key), add_special_tokens=False)
    at = next(i for i in range(len(prompt) - len(needle) + 1) if prompt[i:i + len(needle)] == needle)
    return [at + j for j, t in enumerate(needle) if any(c.isdigit() for c in tok.decode([t]))]


def main() -> int:
    model, lengths, depths, out_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    overrides = sys.argv[5] if len(sys.argv) > 5 else None
    lengths = [int(x) for x in lengths.split(",")]
    depths = [float(x) for x in depths.split(",")]
    haystack, phrasing = os.environ.get("HAYSTACK", "filler"), os.environ.get("NEEDLE", "classic")
    register()  # PRESET may name an evaluation preset (oracle, positions-*)
    llm = LLM(model, attention="infinitehip", preset=os.environ.get("PRESET"), attention_config=overrides,
              max_model_len=max(lengths) + 16, max_num_seqs=1, enforce_eager=True,
              kv_cache_memory_gb=float(os.environ.get("KV_GB", 20)),
              max_num_batched_tokens=int(os.environ.get("MBT", 32768)))
    engine, tok = llm.engine, llm.get_tokenizer()
    method, cfg = engine.backend.method, engine.backend.config
    records: dict[int, list] = {}
    run_stages = method.run_stages

    def spy(layer, q, blocks, keys, *args, **kwargs):
        outs = run_stages(layer, q, blocks, keys, *args, **kwargs)
        if blocks.num_blocks > 1:  # a prefill chunk (decode steps have one block): keep the last block's stages
            stages = outs[0] if isinstance(outs, tuple) else outs
            records[layer] = (int(blocks.ends[-1]), [s[-1].cpu() for s in stages])
        return outs

    method.run_stages = spy
    report = []
    for n in lengths:
        for depth in depths:
            records.clear()
            prompt, key = passkey_prompt(tok, n, depth, 0, haystack, (phrasing,))
            digits = digit_positions(tok, prompt, key, phrasing)
            t0 = time.perf_counter()
            text = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0].text
            layers, line = {}, ""
            for layer in range(engine.model_config.num_layers):
                if layer not in records:
                    line += "."  # dense in this layer
                    continue
                end, stages = records[layer]
                if all(p > end - 1 - cfg.n_window or p < cfg.n_sink for p in digits):
                    line += "w"
                    continue
                per_group = []
                for g in range(stages[0].shape[0]):
                    lost, share = None, 0.0
                    for i, (ids, chunk) in enumerate(zip(stages, cfg.chunk_sizes)):
                        kept = {int(x) for x in ids[g] if x >= 0}
                        share = sum(p // chunk in kept for p in digits) / len(digits)
                        if share == 0 and lost is None:
                            lost = i
                    per_group.append({"lost_at_stage": lost, "last_stage_share": share})
                layers[layer] = per_group
                best = max(per_group, key=lambda r: (r["last_stage_share"], r["lost_at_stage"] or 99))
                line += ("K" if best["last_stage_share"] == 1 else "k" if best["last_stage_share"] > 0
                         else str(best["lost_at_stage"]))
            ok = score(text, key)
            seconds = time.perf_counter() - t0
            print(f"{n:>8} depth {depth:.1f} {'right' if ok else 'wrong'}  {line}  {text.strip()[:24]!r}  "
                  f"{seconds:.1f} s", flush=True)
            report.append({"length": n, "depth": depth, "key": key, "digit_positions": digits, "answer": text,
                           "right": ok, "layers": line, "seconds": seconds, "per_group": layers})
            with open(out_path, "w") as f:
                json.dump({"config": overrides, "preset": os.environ.get("PRESET"), "haystack": haystack,
                           "needle": phrasing, "runs": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
