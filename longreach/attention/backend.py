"""The attention-backend contract and the per-step metadata every backend receives.

A backend turns the queries of one step into attention outputs, reading keys/values from the paged KV cache. Dense is
the backend whose selection is "everything"; the sparse methods (InfiniteHiP, HiP, StreamingLLM, Quest, MInference,
PSA, Cascading KV) are backends too, so the model code never changes with the method.

Life cycle, per engine step (prefill steps and decode steps are separate, see engine/scheduler.py):
  1. the model runner builds `AttentionMetadata` for the batch;
  2. `begin_step(meta)` runs once (shared per-step work: e.g. which sequences need a mask refresh);
  3. for each layer the model stores the new k/v in the cache and calls `forward(layer, q, k, v, cache, meta)`;
  4. when a sequence finishes or is preempted, `free_sequence(seq_id)` drops any state the backend kept for it.
What a backend can do it declares, typed, on its class (`capabilities`: `Capabilities`), and what it asks of the KV
store it declares through `kv_needs` (kvcache/base.py: `KVNeeds`); the engine reads both and probes nothing.

Decode steps may be captured in CUDA graphs unless `capabilities.graph` is `GraphSupport.NONE` (or
`graph_unsupported()` finds a reason in the config): `forward` must then read only the device tensors of `meta`
(their contents change between replays, their shapes do not) and never sync with the host. `STATIC`: one graph per
batch size, captured when the engine starts. `VARIANTS`: the decode step needs per-step host decisions (sparse mask
refreshes), so each graph-decoded step the runner calls `graph_step`, which does the host work, returns the variant's
key (a graph is captured per key and batch size, on first use) and a `load` function that writes the step's inputs
into the backend's own static buffers just before replay (engine/model_runner.py).

Reads as data: in a decode step whose KV store learns from what attention read (the offloaded store installs those
pages on the GPU), `meta.page_reads` is a list; the backend appends one `PageReads` per layer (the index it attended,
device tensors) and the runner hands it to the store (`KVCache.record_reads`) after the layer. The backend never calls
the store.

KV layout: the engine places token t of a sequence in slot t of its pages. A backend that keeps a *bounded* cache of
its own (cascading) sets `kv_layout` instead (a `KVLayout`): the block manager then gives a sequence of n tokens
`slots_for(n)` slots (bounded whatever n) and the model runner stores a step's new tokens at `slot_index`; the backend
moves tokens among its sequence's slots itself.
"""
from __future__ import annotations

import contextlib
import enum
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import torch

from ..kvcache.base import KVNeeds, PageReads

if TYPE_CHECKING:
    import numpy as np

    from ..models.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where every token of the flattened (T, ...) batch belongs. B sequences, T = sum of query lengths."""

    is_prefill: bool
    # host copies (valid for the eager path; a captured decode graph must not depend on them)
    seq_ids: list[int]
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens of each sequence already in the cache before this step
    # device tensors
    query_start_loc: torch.Tensor  # (B+1,) int32: sequence i owns rows [qsl[i], qsl[i+1]) of q
    seq_lens: torch.Tensor  # (B,) int32: context + query length (keys visible to the last query)
    block_tables: torch.Tensor  # (B, max_blocks) int32: page ids; entries past a sequence's pages are padding
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (page * block_size + offset) of each new token
    max_seq_len: int
    max_query_len: int
    # prefill: each sequence's prompt length (tokens the whole prefill covers; a chunk may end before it); None: the
    # prompts end in this step
    prompt_lens: list[int] | None = None
    # decode with a KV store that learns from reads (the offloaded one installs the pages read): the backend appends
    # the index each layer attended (`PageReads`) and the runner hands it to the store after the layer; None: no
    # store asks (prefill, a GPU-resident cache)
    page_reads: list[PageReads] | None = None
    # decode with a store that can install pages inside the step (the offloaded one with head units,
    # `install_reads`): a selection stage about to score candidates that are new this step hands them here first
    # (attention/sparse/selection.py, `install_now`); None: nobody installs early
    install_reads: Callable[[PageReads], None] | None = None
    # a model whose sliding-window layers keep a ring (kvcache/window.py): each sequence's ring slot (B,) int64 and
    # the ring row of each new token (T,) int64 (`slot * window + position % window`; the scratch slot's rows for a
    # prefill chunk's tokens that no later query sees, and for padded graph rows); None: no ring
    window_slots: torch.Tensor | None = None
    window_mapping: torch.Tensor | None = None
    # what a backend derives from this metadata once and reuses in every layer of the step (e.g. attention/dense.py:
    # the pages of each cached prefix, the causal masks), keyed by the backend's own names. Not an __init__ argument:
    # `dataclasses.replace` (a staged prefill's metadata, kvcache/offload.py) starts an empty one
    step_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


class KVLayout(Protocol):
    """Where a bounded cache puts a sequence's tokens among its own slots (local slot i = page table[i // block_size]
    at offset i % block_size); attention/cascading/config.py: CascadeLayout."""

    max_slots: int  # the most slots any sequence uses
    stride: int  # prefill chunks end on multiples of this position (except at a prompt's end): the backend's unit
    side_bytes_per_token: int  # the backend's own state per slot (all layers), beside the K/V rows

    def slots_for(self, num_tokens: int) -> int:
        """Slots a sequence uses once it holds `num_tokens` tokens (monotone; at most `max_slots`)."""
        ...

    def slot_index(self, start: int, n: int) -> "np.ndarray":
        """Local slots (n,) int64 of tokens [start, start + n) fed in one step."""
        ...


class EngineSettings(Protocol):
    """The engine settings a backend reads: config.EngineConfig satisfies it (attention/ sits below config/, which
    validates methods through the registry, so it names this protocol instead of importing EngineConfig)."""

    attention: str
    preset: str | None
    attention_config: dict | None
    model: str
    offload: bool
    block_size: int
    kv_cache_dtype: str
    dtype: str
    max_model_len: int | None
    max_num_batched_tokens: int
    max_num_seqs: int


class GraphSupport(enum.Enum):
    """How a backend's decode step goes through CUDA graphs (engine/model_runner.py; the module docstring)."""

    NONE = "none"  # decode runs eagerly
    STATIC = "static"  # one graph per batch size, captured when the engine starts
    VARIANTS = "variants"  # a graph per batch size and variant key (`graph_step`), captured on first use


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared on its class (`AttentionBackend.capabilities`) and read by the engine."""

    graph: GraphSupport = GraphSupport.NONE  # may decode steps be captured in CUDA graphs, and how
    # one step may carry decode rows and prefill chunks together: the runner then calls begin_step once per part
    # and forward once per part and layer, each with its part's metadata (engine/model_runner.py), so a backend
    # declares it when its per-step state is per sequence (not one plan per step); without it the scheduler
    # alternates prefill steps and decode steps (engine/scheduler.py)
    mixed_batches: bool = False
    prefill_only: bool = False  # cannot decode (alone it decodes densely; composed, another backend does)
    bounded_cache: bool = False  # keeps a bounded cache of its own (kv_layout): cannot be composed


class AttentionBackend(ABC):
    name: ClassVar[str] = ""
    capabilities: Capabilities = Capabilities()  # what it can do (a class's declaration; an instance may refine it)
    kv_layout: KVLayout | None = None  # a bounded cache's slot layout; None: token t in slot t (see the docstring)
    preset_notes: ClassVar[dict[str, str]] = {}  # preset -> one line on what it is for (`longreach backends`)
    # attends each sliding-window layer (ModelConfig.window_of, Gemma 3) within its window (the sparse methods and
    # cascading: through their dense fallback); every built-in backend does, a user's (registry.register_backend)
    # that does not declare it refuses such models (unsupported_reasons)
    honours_layer_windows: ClassVar[bool] = False

    def __init__(self, model_config: "ModelConfig", engine_config: EngineSettings, device: torch.device):
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = device
        self.scale = model_config.attn_scale  # head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5

    # ---- what the KV store must provide (kvcache/build.py sizes the store from it) ---------------------------------
    def kv_needs(self, dtype: torch.dtype) -> KVNeeds:
        return KVNeeds(layout=self.kv_layout, page_state_bytes=self.page_state_bytes(dtype),
                       dense_layers=self.always_dense_layers())

    def page_state_bytes(self, dtype: torch.dtype) -> int:
        """GPU bytes of backend state per KV page (sized with the cache); 0: none."""
        return 0

    def always_dense_layers(self) -> tuple[int, ...]:
        """Layers that attend densely whatever the context (with offloading each reads every page)."""
        return ()

    @classmethod
    def resolve_config(cls, engine_config: EngineSettings) -> object | None:
        """The method's own config from `engine_config.preset` and `.attention_config` (None: it has none). Needs no
        model, so EngineConfig calls it to reject a bad preset or override before anything loads: raise ValueError
        saying what was wrong and what is allowed."""
        return None

    @classmethod
    def unsupported_reasons(cls, model_config: "ModelConfig", engine_config: EngineSettings) -> list[str]:
        """Why this backend cannot serve this model/config (empty: it can): what `resolve_config` says, then what
        `config_problems` finds in the resolved config."""
        if cls.layer_window_problems(model_config):
            return cls.layer_window_problems(model_config)
        try:
            cfg = cls.resolve_config(engine_config)
        except ValueError as e:
            return [str(e)]
        return cls.config_problems(cfg, model_config, engine_config)

    @classmethod
    def layer_window_problems(cls, model_config: "ModelConfig") -> list[str]:
        """A model with sliding-window layers, for a backend that does not honour them: why it cannot run it."""
        if model_config.has_layer_windows and not cls.honours_layer_windows:
            return [f"{model_config.architecture} has sliding-window layers (window {model_config.sliding_window}), "
                    f"which {cls.name} does not honour: run it with dense attention (the default) or a method that "
                    f"attends them densely and selects in the global layers (infinitehip, hip, quest, streaming, psa, "
                    f"minference, cascading)"]
        return []

    @classmethod
    def config_problems(cls, cfg, model_config: "ModelConfig", engine_config: EngineSettings) -> list[str]:
        """What rules out the resolved config `cfg` for this model and engine (empty: nothing). Default: nothing."""
        return []

    def bind_kv_cache(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        """The engine made the KV cache: it holds `capacity_tokens` tokens (with offloading, the host tier's) and the
        model runs in `dtype`. Backends that keep state sized by the cache make it here (stage-0 boxes)."""

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Once per forward pass, before layer 0."""

    def warm_context(self) -> int:
        """The longest context at which some layer still attends densely because the context is short (a sparse
        method's `dense_below`); the server's warm-up prefills a whole chunk past it, so that the method's own
        kernels run once in full-size chunks before the first client. Default: 0 (no such limit)."""
        return 0

    def capture_prefill(self, kv_cache, chunk_rows: list[int]) -> int:
        """Capture up front what this backend would capture at a prefill chunk's first use (chunks of these row
        counts, at every context length), so that the first long prompts do not pay for it; returns how many graphs.
        Default: nothing to capture."""
        return 0

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # (T, H_q, D), RoPE applied at true positions
        k: torch.Tensor,  # (T, H_kv, D) this step's keys (already stored in the cache)
        v: torch.Tensor,  # (T, H_kv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D), keys rotated at their true positions
        v_cache: torch.Tensor,  # (num_blocks, block_size, H_kv, D)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H_q, D)
        ...

    # ---- graph decode (see the module docstring) -------------------------------------------------------------------
    def graph_unsupported(self) -> str | None:
        """Why decode cannot be captured with this backend and config, or None."""
        if self.capabilities.graph is GraphSupport.NONE:
            return f"attention backend {self.name!r} is not graph-capturable"
        return None

    def graph_step(self, seq_ids: list[int], seq_lens: list[int]) -> tuple[tuple, "typing.Callable[[int], None] | None"]:
        """Host side of one graph-decoded step (once per step, in place of `begin_step`): (variant key, load(rows)
        or None). STATIC backends have the one variant ()."""
        return (), None

    def graph_scratch(self) -> None:
        """Point the backend's static buffers at scratch state, so warm-up and capture write nothing real."""

    def graph_warm_keys(self) -> list[tuple[int, tuple]]:
        """Variants worth capturing before serving, as (rows, key) (a VARIANTS backend's long-context ones), so that
        their first use does not stall a batch. Default: none (a STATIC backend captures its one up front)."""
        return []

    @contextlib.contextmanager
    def graph_variant(self, key: tuple):
        """While active, `forward` runs decode as variant `key` from the static buffers (captured or emulated)."""
        yield

    def decode_reads(self) -> dict | None:
        """Cumulative keys read by decode queries, for backends that meter them (psa with count_reads): {"keys",
        "queries", "context_keys"}; None otherwise. Reading it syncs the device."""
        return None

    def free_sequence(self, seq_id: int) -> None:
        """Drop per-sequence state (mask caches, counters) of a finished or preempted sequence."""
