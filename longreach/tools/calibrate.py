"""`longreach calibrate --method minference`: MInference's offline per-head pattern search, written to a JSON file;
and `longreach calibrate crossover`, the decode speed crossover of a sparse method (tools/bench/crossover.py).

    longreach calibrate --method minference --model M (--task kv-retrieval | --text-file F) --length 32k --out P.json
    longreach calibrate crossover --model M --attention METHOD[:PRESET] [--lengths 4k 8k ...]

Runs the model densely over one calibration prompt (the paper: one synthetic KV-retrieval sample of ~30K tokens)
in a single prefill chunk; at each layer, before the dense output goes on to the next layer, the search of
attention/minference/search.py picks each head's pattern by attention-output error against dense. A progress bar
counts layers. The file then serves `--attention minference --attention-config '{"patterns": "P.json"}'`; copied
to longreach/attention/patterns/<alias>.json it ships with longreach, is named `{"patterns": "<alias>"}` and is the
default of a model run by that alias (attention/minference/config.py, `resolve_patterns`).

The JSON (format "longreach-minference-patterns/1"): `provenance` (tools/report.py's record: the command, commit,
device, date; and the model name, path and SHA-256 of its weight files, the data and its SHA-256 or generator seed,
length, longreach version, dtype),
`granularity`, `block`, the `search_space`, and per layer the equal-FLOPs candidates with their kernel work
(`space`, `cost` in keys per query row), every group's error per candidate, and the `choice` per head (or KV group).
A file shipped with longreach must come with the command that reproduced it: the command is in the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time

HELP = ("offline per-head pattern search for minference (writes the pattern file --attention-config loads); "
        "`calibrate crossover`: where sparse decode beats dense")
DESCRIPTION = ("Run a model densely over one calibration prompt and choose, per attention head and layer, the "
               "MInference pattern (Λ-shape, vertical-slash, block-sparse) whose output is closest to dense among "
               "candidates of equal kernel FLOPs. Writes a JSON pattern file with its provenance; use it with "
               "--attention minference --attention-config '{\"patterns\": \"P.json\"}'. "
               "`longreach calibrate crossover --help`: the decode speed crossover of a sparse method.")


def add_arguments(p) -> None:
    from .bench import crossover
    from .eval.common import context_length

    sub = p.add_subparsers(dest="calibrate_what", metavar="{crossover}", required=False)
    crossover.add_arguments(sub.add_parser("crossover", help=crossover.HELP, description=crossover.DESCRIPTION))
    # required unless `crossover` is given: checked in main (argparse would ask for them after the subcommand too)
    p.add_argument("--method", choices=["minference"], help="the method to calibrate (required)")
    p.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", choices=["kv-retrieval"], help="synthetic calibration data (the paper's)")
    src.add_argument("--text-file", metavar="PATH", help="calibrate on the first --length tokens of this text")
    p.add_argument("--length", type=context_length, default=32768, help="prompt tokens, e.g. 32k (default: 32k)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kv-retrieval sample (default: 0)")
    p.add_argument("--out", metavar="P.json", help="where to write the pattern file (required)")
    p.add_argument("--granularity", choices=["head", "kv_head"], default="head",
                   help="one pattern per query head (the paper's) or per KV-head group (default: head)")
    p.add_argument("--target", default="1024,4096", metavar="SINK,LOCAL",
                   help="the Λ-shape whose kernel FLOPs every candidate matches (default: 1024,4096, the paper's)")
    p.add_argument("--verticals", default="30,100,500,3000", metavar="K,K,...",
                   help="vertical counts of the vertical-slash candidates; their slash counts are fitted to the "
                        "budget (default: 30,100,500,3000, Table 7)")
    p.add_argument("--step", type=int, default=50, help="step of the slash-count fit (default: 50, the paper's)")
    p.add_argument("--tie-rtol", type=float, default=0.05,
                   help="prefer the pattern with less online work among candidates within this relative error of "
                        "the best (default: 0.05; 0 = the paper's plain argmin)")
    p.add_argument("--block", type=int, default=64, help="query block / key tile size (default: 64)")
    p.add_argument("--device", default="auto", help="device (default: auto)")
    p.add_argument("--dtype", default="auto", help="dtype (default: auto = bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def kv_retrieval_ids(tokenizer, length: int, seed: int) -> tuple[list[int], dict]:
    """A KV-retrieval prompt of exactly `length` tokens (InfiniteBench's kv_retrieval task, the paper's calibration
    data): a JSON object of random UUID pairs and a question about one of them at a random depth."""
    rng = random.Random(seed)

    def uuid() -> str:
        return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12))

    head = tokenizer.encode("Extract the value corresponding to the specified key in the JSON object below.\n\n"
                            "JSON data:\n{")
    pairs, body = [], []
    room = length - len(head) - 64  # the question and the closing brace fit in 64 tokens
    if room < 64:
        raise ValueError(f"--length {length} is too short for a kv-retrieval prompt (at least {len(head) + 128})")
    while sum(map(len, body)) < room:
        k, v = uuid(), uuid()
        pairs.append((k, v))
        body.append(tokenizer.encode(f'"{k}": "{v}", ', add_special_tokens=False))
    pairs.pop()
    body.pop()
    key, value = pairs[rng.randrange(len(pairs))]
    tail = tokenizer.encode(f'}}\n\nKey: "{key}"\nThe value associated with the specified key is: ',
                            add_special_tokens=False)
    ids = head + [t for b in body for t in b]
    ids = ids + [ids[-1]] * (length - len(ids) - len(tail)) + tail  # pad to exactly `length`
    return ids[:length], {"kind": "kv-retrieval", "seed": seed, "pairs": len(pairs), "key": key, "value": value}


def file_sha256(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def model_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    names = [n for n in os.listdir(path) if n.endswith((".safetensors", ".gguf")) or n == "config.json"]
    return [os.path.join(path, n) for n in names]


def calibrate(engine, token_ids: list[int], space, granularity: str = "head", block: int = 64,
              progress: bool = True) -> list[dict]:
    """Per layer the search result (attention/minference/search.py: space, cost, errors, choice) for `engine` (a
    dense LLMEngine whose max_num_batched_tokens holds the prompt) on `token_ids`."""
    from ..attention.minference import MInference, MInferenceConfig
    from ..attention.minference.search import LayerSearch, search_layer
    from ..progress import Progress

    mc = engine.model_config
    method = MInference(MInferenceConfig(block=block, granularity=granularity, segment=max(block, -(
        -len(token_ids) // block) * block)), mc.num_heads, mc.num_kv_heads)
    backend = engine.backend
    inner = backend.forward
    results: dict[int, dict] = {}
    scale = mc.head_dim ** -0.5
    if engine.device.type == "cuda":
        from ..kernels.vertical_slash import range_attention_triton

        def attend(q, kc, vc, bt, idx):
            return range_attention_triton(q, kc, vc, bt, idx, scale, block_n=block)[0]
    else:
        from ..attention.executor import range_attention

        def attend(q, kc, vc, bt, idx):
            return range_attention(q, kc, vc, bt, idx, scale, need_lse=False)[0]
    bar = Progress(mc.num_layers, "calibrate minference", unit="layer", enabled=progress)

    def spy(layer, q, k, v, k_cache, v_cache, meta):
        out = inner(layer, q, k, v, k_cache, v_cache, meta)
        if meta.is_prefill and meta.context_lens == [0] and meta.query_lens == [len(token_ids)]:
            ls = LayerSearch(method, layer, q, k_cache, v_cache, meta.block_tables[0], len(token_ids), scale, attend)
            results[layer] = search_layer(ls, out, space)
            bar.update(1)
        return out

    backend.forward = spy
    try:
        engine.prompt_logits(token_ids, return_logits=False)
    finally:
        backend.forward = inner
        bar.close()
    if len(results) != mc.num_layers:
        raise RuntimeError(f"the calibration prompt ran in {len(results)} of {mc.num_layers} layers as one chunk")
    return [results[i] for i in range(mc.num_layers)]


def main(args) -> int:
    if getattr(args, "calibrate_what", None) == "crossover":
        from .bench import crossover

        return crossover.main(args)
    missing = [flag for flag, value in (("--method", args.method), ("--task or --text-file", args.task or
                                                                      args.text_file), ("--out", args.out)) if not value]
    if missing:
        raise ValueError(f"the minference calibration needs {', '.join(missing)} (or: longreach calibrate crossover)")
    return _minference(args)


def _minference(args) -> int:
    from .. import __version__
    from ..attention.minference import PATTERNS_FORMAT
    from .report import command_line, provenance, samples
    from ..attention.minference.search import SearchSpace
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import resolve_model_path

    target, verticals = _ints(args.target, "--target"), _ints(args.verticals, "--verticals")
    if len(target) != 2:
        raise ValueError(f"--target must be SINK,LOCAL, got {args.target!r}")
    space = SearchSpace(target=target, verticals=verticals, step=args.step, tie_rtol=args.tie_rtol)
    if args.block not in (16, 32, 64, 128):
        raise ValueError(f"--block must be 16, 32, 64 or 128, got {args.block}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--out: the directory {out_dir} does not exist")
    text_sha = None
    if args.text_file:
        from .eval.data import read_text_file

        text = read_text_file(args.text_file)
        text_sha = hashlib.sha256(text.encode()).hexdigest()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    max_model_len=args.length, max_num_batched_tokens=max(16, args.length),
                                    max_num_seqs=1))
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer: calibration data is text")
    if args.text_file:
        ids = engine.tokenizer.encode(text)
        if len(ids) < args.length:
            raise ValueError(f"--text-file has {len(ids)} tokens, fewer than --length {args.length}")
        ids = ids[:args.length]
        data = {"kind": "text-file", "path": os.path.abspath(args.text_file), "sha256": text_sha}
    else:
        ids, data = kv_retrieval_ids(engine.tokenizer, args.length, args.seed)
    layers = calibrate(engine, ids, space, args.granularity, args.block, progress=not args.no_progress)
    path = resolve_model_path(args.model)
    report = {
        "format": PATTERNS_FORMAT,
        "provenance": provenance(  # tools/report.py's record, with the calibration's own fields
            command_line(args), engine.device, samples=samples(1, "run", f"prompt of {args.length} tokens"),
            model=engine.model_config.name, model_path=os.path.abspath(path),
            model_sha256=file_sha256(model_files(path)), data=data, length=args.length,
            longreach_version=__version__, dtype=str(engine.dtype).replace("torch.", ""),
            seconds=round(time.perf_counter() - t0, 1)),
        "granularity": args.granularity, "block": args.block,
        "num_layers": engine.model_config.num_layers, "num_heads": engine.model_config.num_heads,
        "num_kv_heads": engine.model_config.num_kv_heads,
        "search_space": space.to_json(),
        "layers": layers,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    counts: dict[str, int] = {}
    for layer in layers:
        for p in layer["choice"]:
            counts[p[0]] = counts.get(p[0], 0) + 1
    total = sum(counts.values())
    print(f"[longreach] calibrate: {args.out}: " + ", ".join(f"{k} {v}/{total}" for k, v in sorted(counts.items()))
          + f" ({report['provenance']['seconds']} s)", file=sys.stderr)
    return 0
