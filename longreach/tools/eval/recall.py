"""How much of the exact attention a sparse selection keeps, measured on a model's real queries and keys.

Metrics, per query row and head, averaged:
  * attention-mass recall: the share of the exact softmax mass (over all causal keys) that the attended keys hold;
  * top-k key recall: of the B keys the row attends to, the share that are among its B highest-scoring keys (oracle);
  * output relative error: ||o_sparse - o_dense|| / ||o_dense||, o_sparse the softmax over the attended keys only;
  * keys attended per query: the mean, and its distribution over (layer, row, head) (p50, p90, p99, max), which
    is what differs between a fixed budget (infinitehip, quest) and a mass threshold (psa).
`capture` runs the model densely on a text and keeps, per layer, the RoPE'd queries of the evaluated rows and all keys
and values; `evaluate` runs a selection method on them exactly as its prefill does (query blocks of b_q rows).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...attention.index import QueryBlocks, SparseIndex
from ...attention.sparse import SelectionMethod


@dataclass
class Capture:
    positions: torch.Tensor  # (R,) positions of the evaluated query rows (the last R of the text)
    q: list[torch.Tensor]  # per layer (R, H_q, D)
    k: list[torch.Tensor]  # per layer (L, H_kv, D), rotated at true positions
    v: list[torch.Tensor]  # per layer (L, H_kv, D)


def capture(engine, token_ids: list[int], num_queries: int) -> Capture:
    """Dense prefill of `token_ids` through `engine` (a dense LLMEngine), keeping q of the last `num_queries` rows."""
    L = len(token_ids)
    first = L - num_queries
    qs, ks, vs = {}, {}, {}
    backend = engine.backend
    inner = backend.forward

    def spy(layer, q, k, v, k_cache, v_cache, meta):
        (c,), (n,) = meta.context_lens, meta.query_lens
        lo = max(first, c)
        if lo < c + n:
            qs.setdefault(layer, []).append(q[lo - c:].float().cpu())
        if c + n == L:  # last chunk: the whole sequence is in the cache
            from ...kvcache.paged import gather_tokens

            ks[layer] = gather_tokens(k_cache, meta.block_tables[0], L).float().cpu()
            vs[layer] = gather_tokens(v_cache, meta.block_tables[0], L).float().cpu()
        return inner(layer, q, k, v, k_cache, v_cache, meta)

    backend.forward = spy
    try:
        engine.prompt_logits(token_ids, return_logits=False)
    finally:
        backend.forward = inner
    n_layers = engine.model_config.num_layers
    return Capture(torch.arange(first, L), [torch.cat(qs[i]) for i in range(n_layers)],
                   [ks[i] for i in range(n_layers)], [vs[i] for i in range(n_layers)])


def attended_mask(index: SparseIndex, row_pos: torch.Tensor, block_of_row: torch.Tensor, L: int,
                  num_heads: int) -> torch.Tensor:
    """(R, H_q, L) bool: the keys each row and head reads under `index` (sink | selected | window)."""
    k = torch.arange(L)
    p = row_pos[:, None]
    sink = (k[None, :] < index.n_sink) & (k[None, :] <= p)
    window = (k[None, :] >= torch.clamp(p - index.n_window + 1, min=index.n_sink)) & (k[None, :] <= p)
    base = (sink | window)[:, None, :].expand(-1, num_heads, L).clone()  # (R, H_q, L)
    per_group = torch.zeros(index.queries.num_blocks, index.groups, L, dtype=torch.bool)
    ids = index.blocks.long().cpu()
    for j in range(index.block_k):  # mark every token of every selected block
        pos = ids * index.block_k + j
        ok = (ids >= 0) & (pos < L)
        per_group.scatter_(2, torch.where(ok, pos, 0), ok)
    heads_per_group = num_heads // index.groups
    sel = per_group[block_of_row].repeat_interleave(heads_per_group, dim=1)  # (R, H_q, L)
    admissible = (k[None, :] >= index.n_sink) & (k[None, :] <= p - index.n_window)
    return base | (sel & admissible[:, None, :])


class LayerReference:
    """Exact attention of the evaluated rows of one layer, computed once and shared by every method's metrics."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_pos: torch.Tensor, scale: float):
        R, Hq, D = q.shape
        L = k.shape[0]
        gqa = Hq // k.shape[1]
        self.vh = v.repeat_interleave(gqa, dim=1).transpose(0, 1)  # (H_q, L, D)
        s = torch.einsum("rhd,hld->rhl", q, k.repeat_interleave(gqa, dim=1).transpose(0, 1)) * scale
        self.causal = torch.arange(L)[None, None, :] <= row_pos[:, None, None]
        self.scores = s.masked_fill(~self.causal, float("-inf"))  # (R, H_q, L)
        self.probs = torch.softmax(self.scores, dim=-1)
        self.sorted = self.scores.sort(dim=-1, descending=True).values
        self.out = torch.einsum("rhl,hld->rhd", self.probs, self.vh)

    def metrics(self, mask: torch.Tensor) -> dict:
        """mask (R, H_q, L) of attended keys -> mean recall metrics over rows and heads."""
        mask = mask & self.causal
        mass = (self.probs * mask).sum(-1)
        budget = mask.sum(-1)  # (R, H_q)
        threshold = self.sorted.gather(-1, (budget - 1).clamp(min=0)[..., None])  # score of the budget-th best key
        topk = ((mask & (self.scores >= threshold)).sum(-1).float() / budget.clamp(min=1)).mean()
        sparse = torch.softmax(self.scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.einsum("rhl,hld->rhd", sparse, self.vh)
        err = (out - self.out).norm(dim=-1) / self.out.norm(dim=-1).clamp(min=1e-12)
        return {"mass_recall": mass.mean().item(), "topk_recall": topk.item(), "output_rel_error": err.mean().item(),
                "keys_per_query": budget.float().mean().item(), **keys_distribution(budget, "keys_per_query_")}


def keys_distribution(budget: torch.Tensor, prefix: str = "") -> dict:
    """p50 / p90 / p99 / max of keys read per (row, head) (any shape; mean included without a prefix)."""
    b = budget.flatten().double()
    q = torch.quantile(b, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist() if b.numel() else [0.0] * 3
    out = {f"{prefix}p50": q[0], f"{prefix}p90": q[1], f"{prefix}p99": q[2], f"{prefix}max": b.max().item() if
           b.numel() else 0.0}
    return out if prefix else {"mean": b.mean().item() if b.numel() else 0.0, **out}


def metrics(q, k, v, row_pos, mask, scale) -> dict:
    """q (R, H_q, D), k/v (L, H_kv, D), mask (R, H_q, L) -> mean recall metrics over rows and heads."""
    return LayerReference(q, k, v, row_pos, scale).metrics(mask)


def selection_mask(method: SelectionMethod, layer: int, q: torch.Tensor, k: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """(R, H_q, L) keys read by each evaluated row under `method`'s prefill selection."""
    if hasattr(method, "selection_mask"):  # methods with their own index format (minference: key ranges + columns)
        return method.selection_mask(layer, q, k, positions)
    R, L = positions.numel(), k.shape[0]
    qb = QueryBlocks.build([R], [int(positions[0])], method.cfg.block_q)
    sels = method.select(layer, q, list(zip(qb.start, qb.length, qb.pos)), k)  # (nb, G, W)
    blocks, counts = SparseIndex.pack([sels], "cpu")
    index = SparseIndex(method.cfg.block_q, method.block_k, method.cfg.n_sink, method.cfg.n_window, method.groups,
                        qb, blocks, counts)
    block_of_row = torch.repeat_interleave(torch.arange(qb.num_blocks), torch.tensor(qb.length))
    return attended_mask(index, positions, block_of_row, L, q.shape[1])


def evaluate(methods: dict[str, SelectionMethod | None], cap: Capture, scale: float) -> dict:
    """Per-layer and mean metrics of each method (None: dense) on a capture; a method's dense layers count as dense."""
    per_layer: dict[str, list[dict]] = {name: [] for name in methods}
    budgets: dict[str, list[tuple[bool, torch.Tensor]]] = {name: [] for name in methods}  # (dense, keys per row/head)
    import time

    from .common import note

    R = cap.positions.numel()
    t0 = time.perf_counter()
    for layer, (q, k, v) in enumerate(zip(cap.q, cap.k, cap.v)):
        if layer:  # selections at long contexts take minutes on a CPU: say how far it is
            done = time.perf_counter() - t0
            note(f"recall: layer {layer + 1}/{len(cap.q)}, {done:.0f} s so far, "
                 f"~{done / layer * (len(cap.q) - layer):.0f} s left")
        ref = LayerReference(q, k, v, cap.positions, scale)
        for name, method in methods.items():
            dense = method is None or layer in method.cfg.dense_layers
            if dense:
                mask = torch.ones(R, q.shape[1], k.shape[0], dtype=torch.bool)
            else:
                mask = selection_mask(method, layer, q, k, cap.positions)
            per_layer[name].append({"layer": layer, "dense": dense, **ref.metrics(mask)})
            budgets[name].append((dense, (mask & ref.causal).sum(-1).flatten()))
    keys = ("mass_recall", "topk_recall", "output_rel_error", "keys_per_query")

    def mean(rows):
        return {key: sum(r[key] for r in rows) / len(rows) for key in keys} if rows else None

    def distribution(name, sparse_only):
        parts = [b for dense, b in budgets[name] if not (sparse_only and dense)]
        return keys_distribution(torch.cat(parts)) if parts else None

    return {name: {"mean": mean(rows), "mean_sparse_layers": mean([r for r in rows if not r["dense"]]),
                   "keys_per_query": {"all_layers": distribution(name, False),
                                      "sparse_layers": distribution(name, True)},
                   "per_layer": rows,
                   "config": dataclasses.asdict(methods[name].cfg) if methods[name] is not None else None}
            for name, rows in per_layer.items()}


def run(model: str, text: str, length: int, methods: list, attention_config: dict | str | None,
        num_queries: int, device: str, dtype: str) -> dict:
    """Capture `model` on the first `length` tokens of `text` and evaluate each method (`common.RunSpec`)."""
    import json

    from ...attention.registry import get_backend_class
    from ...config import EngineConfig
    from ...engine.llm_engine import LLMEngine
    from .common import eval_config, method_config

    attention_config = eval_config(attention_config)  # a dict (JSON text from a Python caller: parsed once, here)
    if num_queries < 1 or num_queries > length:
        raise ValueError(f"--queries must be in [1, --length], got {num_queries}")
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_model_len=length,
                                    max_num_seqs=1))
    ids = engine.tokenizer.encode(text) if engine.tokenizer else None
    if ids is None or len(ids) < length:
        raise ValueError(f"the text has {0 if ids is None else len(ids)} tokens, fewer than --length {length}")
    cap = capture(engine, ids[:length], num_queries)
    mc = engine.model_config
    report = {"model": mc.name, "length": length, "queries": num_queries, "device": str(engine.device),
              "dtype": str(engine.dtype).replace("torch.", ""), "methods": {}}
    composed = [s.label for s in methods if s.decode]
    if composed:  # recall reads prompt rows only: a composed method is measured by its prefill selection
        report["note"] = f"{', '.join(composed)}: prefill selection measured (recall covers prompt rows, not decode)"
    built: dict[str, SelectionMethod | None] = {}
    for spec in methods:
        if spec.name == "dense":
            built[spec.label] = None
            continue
        cls = get_backend_class(spec.name)
        cfg = cls.resolve_config(EngineConfig(attention=spec.name, preset=spec.preset,
                                              attention_config=method_config(spec, attention_config)))
        built[spec.label] = cls.method_cls(cfg, mc.num_heads, mc.num_kv_heads)
    report["methods"] = evaluate(built, cap, mc.head_dim ** -0.5)
    json.dumps(report)  # fail here, not after printing half of it
    return report
