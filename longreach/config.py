"""Engine configuration: one frozen dataclass whose fields are the CLI flags and the `LLM(...)` keyword arguments.

Importing it imports no torch. Validated in `__post_init__` with messages that say what is allowed; a preset or
`attention_config` is checked against its method's config there too, which imports that backend's module.
`attention_config` and `decode_attention_config` are dicts inside; the JSON text of the CLI (or of older Python code)
is parsed once, here (`config_dict`).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
KV_DTYPES = ("auto", "bfloat16", "float16", "fp8")
DENSE_PREFILL = ("sdpa", "paged")


def _f(default: Any, help: str, hash: bool = True):
    return field(default=default, hash=hash, metadata={"help": help})


def config_dict(value: Any, what: str = "attention_config") -> dict | None:
    """A method's config overrides as a dict: `value` is None, a dict (copied, so later changes to the caller's
    dict do not reach the engine) or its JSON text, parsed here. Anything else raises ValueError naming `what`, what
    was wrong and what is allowed."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    if isinstance(value, (str, bytes, bytearray)):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} must be a JSON object (a dict, or its JSON text), got {value!r} "
                             f"({e.msg})") from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"{what} must be a JSON object (a dict, or its JSON text such as '{{\"n_sink\": 128}}'), got "
                     f"{type(value).__name__} {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = _f("smollm2", "model: an alias (smollm2), a Hugging Face model directory, or a .gguf file")
    attention: str = _f("dense", "attention backend (see `longreach backends`)")
    preset: str | None = _f(None, "named configuration of the attention method, e.g. 3k, 5k, 3k-fast, 3k-flash for "
                                  "infinitehip; default: the method's own")
    # the two method configs: a dict, or its JSON text (the CLI's, or older Python code's), parsed in __post_init__
    attention_config: dict | None = _f(None, "JSON object overriding fields of the method's config, e.g. "
                                             "'{\"n_sink\": 128, \"dense_layers\": [0, 1]}'", hash=False)
    decode_attention: str | None = _f(None, "a different attention method for decode steps, METHOD[:PRESET] (e.g. "
                                            "--attention minference --decode-attention infinitehip:3k-fast); "
                                            "default: --attention's own decode (dense for minference)")
    decode_attention_config: dict | None = _f(None, "JSON object overriding fields of the decode method's config "
                                                    "(with --decode-attention)", hash=False)
    dtype: str = _f("auto", "weights, activations and KV cache dtype; auto = bfloat16 on CUDA, float32 on CPU")
    device: str = _f("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    cpu_threads: int | None = _f(None, "torch threads on a CPU; default: auto, the cores this process may use minus "
                                       "those other processes keep busy (at least 1), unless OMP_NUM_THREADS is set")
    max_model_len: int | None = _f(None, "longest sequence (prompt + output) in tokens; default: the model's "
                                         "trained context length")
    max_num_batched_tokens: int = _f(8192, "tokens per step: the running requests' decode tokens first, then "
                                           "prefill chunks (a prompt alone is prefilled in chunks this big)")
    max_num_seqs: int = _f(64, "most sequences running at once")
    long_prefill_token_threshold: int | None = _f(None, "most prompt tokens one sequence prefills in a step while "
                                                        "other sequences run or wait (a prompt with more left is "
                                                        "long); default: max_num_batched_tokens / 4")
    max_num_partial_prefills: int = _f(4, "most sequences part-way through their prefill at once")
    max_long_partial_prefills: int = _f(2, "most long prompts (see long_prefill_token_threshold) part-way through "
                                           "their prefill at once: more wait, shorter ones behind them may start")
    mixed_step_target_ms: float | None = _f(None, "while requests decode, size each prompt's prefill chunk so that a "
                                                  "step takes about this long (measured; powers of two from 256 to "
                                                  "long_prefill_token_threshold; engine/pacing.py): lower inter-token "
                                                  "latency for the others, a slower prefill for the prompt; default: "
                                                  "off")
    quantization: str | None = _f(None, "weights: fp8 (the decoder's linear layers in float8 e4m3 with a scale per "
                                        "output channel, activations quantised per token; models/fp8.py: half the "
                                        "bytes a decode step reads); default: the run dtype")
    block_size: int = _f(16, "tokens per KV-cache page")
    gpu_memory_utilization: float = _f(0.90, "share of GPU memory for weights, activations and the KV cache")
    kv_cache_memory_gb: float | None = _f(None, "KV cache size in GiB (per rank with "
                                                "--tensor-parallel-size); default: what gpu_memory_utilization leaves "
                                                "on CUDA, up to 4 GiB on CPU")
    rope_scaling: str | None = _f(None, "JSON object overriding the model's RoPE scaling, as vLLM's --rope-scaling, "
                                        "e.g. '{\"rope_type\": \"yarn\", \"factor\": 4.0}' (rope_type: linear, "
                                        "dynamic, llama3, yarn; original_max_position_embeddings defaults to the "
                                        "model's trained length)")
    kv_cache_dtype: str = _f("auto", "KV cache element type: auto (the run dtype), bfloat16, float16, or fp8 (e4m3 "
                                     "with one fp32 scale per token and KV head; dequantised on load)")
    kv_offloading_size: float | None = _f(None, "host-memory tier of the KV cache in GiB (pinned): every page lives "
                                                "there and --kv-cache-memory-gb becomes the GPU page cache; "
                                                "with --tensor-parallel-size, per rank (each GPU offloads its own KV "
                                                "heads; the total is N times this); 0 or absent: no offloading "
                                                "(sparse attention only)")
    kv_offload_unit: str = _f("head", "with --kv-offloading-size: what one GPU slot holds, 'head' (one KV head's "
                                      "page: a selection that reads one head installs that head's page only, and "
                                      "the selection stages' keys are installed too; docs/design-offload-heads.md) "
                                      "or 'page' (a page of every KV head)")
    enforce_eager: bool = _f(False, "no CUDA graphs: decode, prefill chunks and the sparse methods' prefill selection "
                                    "run eagerly")
    chunk_graph_max_tokens: int = _f(2048, "largest prefill step (tokens) whose work around attention replays from "
                                           "CUDA graphs, attention eager between them (engine/chunk_graphs.py): "
                                           "captured for the scheduler's chunk sizes up to it and the powers of two "
                                           "from 256, a step padded to the next; larger steps run eagerly; 0: off")
    dense_prefill: str = _f("sdpa", "how dense attention (--attention dense, and the sparse methods' dense layers and "
                                    "short contexts) reads a prefill chunk's cached prefix: sdpa (gathered out of the "
                                    "paged cache, expanded over the GQA group, PyTorch SDPA) or paged (read in place "
                                    "by the block-sparse kernel, every causal key block selected; slower than sdpa on "
                                    "an H200: docs/serving.md)")
    tensor_parallel_size: int = _f(1, "split the model over this many processes: attention heads, MLP and "
                                      "vocabulary, each rank its share of the KV cache and of the offloaded tier; "
                                      "every attention method at granularity kv_head or head; fp8 weights with one "
                                      "process's scales; generate, serve and the LLM API. This process starts the "
                                      "others on one host (rank r on cuda:r; gloo over CPU processes with --device "
                                      "cpu), or, under torchrun, it must equal WORLD_SIZE (rank r on "
                                      "cuda:LOCAL_RANK; --nnodes for several hosts). No CUDA graphs yet; tested on "
                                      "CPU processes only (docs/design-tensor-parallel.md)")
    seed: int = _f(0, "random seed for requests that give none")

    def __post_init__(self) -> None:
        def bad(what: str) -> None:
            raise ValueError(what)

        if not isinstance(self.model, str) or not self.model:
            bad("model must be a non-empty string: an alias (smollm2), a HF model directory or a .gguf file")
        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device in DEVICES or (isinstance(self.device, str) and self.device.startswith("cuda:"))):
            bad(f"device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(
                self.cpu_threads, int) or self.cpu_threads < 1):
            bad(f"cpu_threads must be a positive integer (or absent: auto), got {self.cpu_threads!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            bad(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 16:
            bad(f"max_num_batched_tokens must be an integer >= 16, got {self.max_num_batched_tokens!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            bad(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if self.long_prefill_token_threshold is not None and (
                not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 1):
            bad(f"long_prefill_token_threshold must be a positive integer (or absent: max_num_batched_tokens / 4), "
                f"got {self.long_prefill_token_threshold!r}")
        if self.mixed_step_target_ms is not None and (isinstance(self.mixed_step_target_ms, bool) or not isinstance(
                self.mixed_step_target_ms, (int, float)) or not 0 < self.mixed_step_target_ms < float("inf")):
            bad(f"mixed_step_target_ms must be a positive number of milliseconds (or absent: off), "
                f"got {self.mixed_step_target_ms!r}")
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(f"{name} must be a positive integer, got {value!r}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            bad(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be at most "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            bad(f"block_size must be a power of two in [1, 256], got {self.block_size!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in [0.05, 1.0], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            bad(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.rope_scaling is not None:
            try:
                rope = json.loads(self.rope_scaling)
            except json.JSONDecodeError as e:
                bad(f"rope_scaling must be a JSON object, got {self.rope_scaling!r} ({e.msg})")
            if not isinstance(rope, dict) or not rope:
                bad(f"rope_scaling must be a non-empty JSON object such as '{{\"rope_type\": \"yarn\", "
                    f"\"factor\": 4.0}}', got {self.rope_scaling!r}")
        if self.quantization not in (None, "fp8"):
            bad(f"quantization must be fp8 (or absent: the run dtype), got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_DTYPES:
            bad(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dense_prefill not in DENSE_PREFILL:
            bad(f"dense_prefill must be one of {', '.join(DENSE_PREFILL)} (sdpa: the prefix gathered for PyTorch SDPA; "
                f"paged: read in place by the block-sparse kernel), got {self.dense_prefill!r}")
        if isinstance(self.chunk_graph_max_tokens, bool) or not isinstance(self.chunk_graph_max_tokens, int) or \
                self.chunk_graph_max_tokens < 0:
            bad(f"chunk_graph_max_tokens must be an integer >= 0 (0: prefill chunks without CUDA graphs), "
                f"got {self.chunk_graph_max_tokens!r}")
        if self.kv_offloading_size is not None and (isinstance(self.kv_offloading_size, bool) or not isinstance(
                self.kv_offloading_size, (int, float)) or self.kv_offloading_size < 0):
            bad(f"kv_offloading_size must be a number of GiB >= 0 (0: no offloading), got {self.kv_offloading_size!r}")
        if self.kv_offload_unit not in ("page", "head"):
            bad(f"kv_offload_unit must be 'page' or 'head' (what one GPU slot of the offloaded KV holds), got "
                f"{self.kv_offload_unit!r}")
        self._check_tensor_parallel()
        from .attention.registry import MethodSpec, check_backend_name

        check_backend_name(self.attention)
        if self.decode_attention is not None:
            MethodSpec.parse(self.decode_attention, what="decode_attention")  # _check_methods
        if self.decode_attention_config is not None and self.decode_attention is None:
            bad("decode_attention_config needs decode_attention (the method it configures)")
        for name in ("attention_config", "decode_attention_config"):  # JSON text is parsed here, once
            object.__setattr__(self, name, config_dict(getattr(self, name), name))
        self._check_methods()
        self._check_tensor_parallel_methods()

    def _check_methods(self) -> None:
        """The attention method's preset and overrides, and the decode method's, checked now: a typo fails before
        any model loads (not after, as "cannot run this model"). Imports the named backends' modules (torch), so only
        when there is something to check: the default presets are valid."""
        if self.preset is not None or self.attention_config is not None:
            from .attention.registry import check_method_config

            check_method_config(self)
        if self.decode_attention is not None:
            from .attention.compose import decode_config

            try:
                decode_config(self)  # an EngineConfig of the decode method alone: its __post_init__ checks it
            except ValueError as e:
                raise ValueError(f"decode_attention {self.decode_attention!r}: {e}") from None

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism runs (issue 32; docs/design-tensor-parallel.md): every attention method whose
        selection is local to a rank's heads, the offloaded KV store (each rank its own heads' pages), fp8 weights
        (models/fp8.py: the row-parallel layers' scales over every rank). The rest is refused here, before any
        process starts, rather than run untested; the methods' `granularity` is checked after their configs are
        parsed (`_check_tensor_parallel_methods`)."""
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if n == 1:
            return
        if self.device.startswith("cuda:"):
            raise ValueError(f"tensor_parallel_size={n}: device {self.device!r} names one GPU: use --device cuda "
                             f"(rank r runs on cuda:r)")

    def _check_tensor_parallel_methods(self) -> None:
        """With tensor parallelism a method selects per KV group or per head, both local to a rank; granularity
        "layer" pools every KV head's scores of a layer, which no rank holds (it would need a collective per stage).
        Resolves the method's config (imports its module). The decode method's is checked by its own EngineConfig
        (`_check_methods`: compose.decode_config)."""
        if self.tensor_parallel_size == 1:
            return
        from .attention.registry import get_backend_class

        granularity = getattr(get_backend_class(self.attention).resolve_config(self), "granularity", None)
        if granularity == "layer":
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size}: attention {self.attention} with granularity "
                f"\"layer\" pools the scores of every KV head of a layer, and each rank holds only its own KV heads; "
                f"use granularity \"kv_head\" (the default) or \"head\"")

    @property
    def offload(self) -> bool:
        """Is the KV cache offloaded to host memory (a host tier of > 0 GiB)?"""
        return bool(self.kv_offloading_size)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata.get("help", "") for f in fields(cls) if f.name == name)


def parse_method(text: str, what: str = "attention method"):
    """`METHOD[:PRESET]` as an `attention.registry.MethodSpec`, its preset checked: ValueError naming the known methods
    (unknown method) or the method's presets (unknown preset; this imports the backend's module)."""
    from .attention.registry import MethodSpec

    spec = MethodSpec.parse(text, what)
    if spec.preset is not None:
        EngineConfig(attention=spec.method, preset=spec.preset)  # its __post_init__ resolves the method's config
    return spec
