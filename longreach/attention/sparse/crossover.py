"""The measured decode crossover: the context from which a sparse method's decode step beats dense attention's, one
JSON file per key under <cache>/crossover/ (<cache>: $LONGREACH_CACHE, else ~/.cache/longreach; models/hub.py).
`longreach calibrate crossover` writes them (tools/bench/crossover.py); a sparse backend with
`"dense_below_decode": "auto"` reads its key's file at start-up (sparse/backend.py). docs/design-crossover.md has the
plan; this settles its open points as follows.

Key (`key_fields`): the model shape (layers, heads, KV heads, head dim, hidden size, intermediate size), the device
("NVIDIA H100 80GB HBM3", or "cpu"), the method's name and its resolved config's SHA-256 without `dense_below` and
`dense_below_decode` (what it selects and how, not where it hands over to dense; the calibration runs with both 0),
and the run dtype and KV cache dtype as configured ("auto" included: on a GPU that is always bfloat16). A config
field added after measurements were keyed is left out at the value that selects as before it existed
(`UNKEYED_DEFAULTS`: infinitehip's `lookahead` 0, `ahead` false and `query_stride` None), so those measurements
keep their key. The file is <method>-<16 hex digits of the key's SHA-256>.json and holds its key: a file whose key
differs is not used.

File (format "longreach-crossover/1"): key, command, commit, device, date, `lengths`, the median decode step seconds
of `dense` and `method` at each length (lists in the order of `lengths`), and `crossover`.

Rule (`crossover_length`): the crossover is the smallest measured length from which the method's step is faster at
every longer measured length; None when it is not faster at the longest. "auto" then decodes densely up to
min(trained context, crossover) tokens (`decode_limit`; None: the trained context). The crossover length itself,
and the unmeasured lengths just below it, thus still decode densely: dense wherever sparse is not shown faster.
With no file for the key, "auto" is exactly `dense_below`'s limit (behaviour never changes silently) and the backend
logs one line naming `MEASURE_COMMAND`.

Importing this module imports no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from ...models.hub import cache_root

FORMAT = "longreach-crossover/1"
MEASURE_COMMAND = "longreach calibrate crossover --model M --attention METHOD[:PRESET]"
LIMIT_FIELDS = ("dense_below", "dense_below_decode")  # left out of the key: the calibration sets both to 0
# left out of the key at these values (module docstring)
UNKEYED_DEFAULTS = {"lookahead": 0, "ahead": False, "query_stride": None}


def device_name(device) -> str:
    """"cpu", or the CUDA device's name."""
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def key_fields(model_config, method: str, config, engine_config, device) -> dict:
    """The key of a measurement (module docstring): what decides which of dense and the method decodes faster."""
    mc = model_config
    selection = {k: v for k, v in dataclasses.asdict(config).items()
                 if k not in LIMIT_FIELDS and (k not in UNKEYED_DEFAULTS or v != UNKEYED_DEFAULTS[k])}
    return {"num_layers": mc.num_layers, "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim, "hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size,
            "device": device_name(device), "method": method, "config_sha256": _digest(selection),
            "dtype": engine_config.dtype, "kv_cache_dtype": engine_config.kv_cache_dtype}


def crossover_dir() -> str:
    return os.path.join(cache_root(), "crossover")


def path_of(key: dict, directory: str | None = None) -> str:
    return os.path.join(directory or crossover_dir(), f"{key['method']}-{_digest(key)[:16]}.json")


def load(key: dict, directory: str | None = None) -> dict | None:
    """The measurement of `key`, or None (no file, an unreadable one, or one written for another key)."""
    try:
        with open(path_of(key, directory)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("key") != key:
        return None
    return record


def write(record: dict, directory: str | None = None) -> str:
    """Write a measurement (its "key" names the file); returns the path."""
    path = path_of(record["key"], directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **record}, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def crossover_length(lengths: list[int], dense_s: list[float], method_s: list[float]) -> int | None:
    """The smallest of `lengths` (ascending) from which the method's step time is below dense's at every longer
    length; None when the method is not faster at the longest."""
    found = None
    for length, d, m in reversed(list(zip(lengths, dense_s, method_s))):
        if not m < d:
            break
        found = length
    return found


def decode_limit(record: dict, trained: int) -> int:
    """"auto"'s decode limit from a measurement: min(trained, crossover), the trained context without one."""
    c = record.get("crossover")
    return trained if c is None else min(trained, int(c))
