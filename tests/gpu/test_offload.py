"""KV offloading on the GPU: every kernel reading through the page table (resident slots + pinned host pages over UVA)
bit for bit against the one-tier cache, the copy kernels, and the engine with an offloaded KV cache on a real model."""
from __future__ import annotations

import gc
import time

import torch

from .common import essay_text, two_tier


def test_offload_kernels(detail):
    """Every kernel reading through the page table (resident slots + pinned host pages over UVA) gives bit-identical
    results to the same kernel on the one-tier cache; the copy kernels are bit-exact; a captured graph reads the
    page table's current contents at replay."""
    from longreach.kernels.offload_copy import copy_chunks, scatter_rows
    from longreach.kvcache.fp8 import encode

    dev = "cuda"
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        g = torch.Generator(device=dev).manual_seed(3)
        Hkv, D, page = 8, 128, 16
        L = [131072 + 5, 40000]
        need = [-(-x // page) for x in L]
        P = sum(need) + 2
        # fp8 caches hold rows of D values + their scale (kvcache/fp8.py): encode() writes that format
        kc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        vc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        perm = torch.randperm(P, device=dev, generator=g).int()
        tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
        tables[0, :need[0]], tables[1, :need[1]] = perm[:need[0]], perm[need[0]:need[0] + need[1]]
        for units in (1, Hkv):  # a slot per page, per KV head's page
            _check_tiered(kc, vc, *two_tier(kc, vc, 0.3, g, units), tables, L, dtype, units, g, D)
        rows.append(str(dtype).replace("torch.", ""))
        # copy kernels: host pages -> GPU, GPU rows -> host
        src = kc.cpu().pin_memory()
        si = torch.randperm(P, device=dev, generator=g)[:4096]
        di = torch.randperm(P, device=dev, generator=g)[:4096]
        dst = torch.zeros_like(kc)
        skip = torch.arange(4096, device=dev) % 5 == 0  # a negative source copies nothing (install_reads' padding)
        copy_chunks(src, torch.where(skip, -1, si), dst, di, kc[0].numel())
        if not torch.equal(dst[di[~skip]].view(torch.uint8), kc[si[~skip]].view(torch.uint8)):
            raise AssertionError(f"copy_chunks {dtype} not bit-exact")
        if bool(dst[di[skip]].view(torch.uint8).any()):
            raise AssertionError(f"copy_chunks {dtype} wrote an entry whose source index was negative")
        loop = torch.zeros_like(kc)  # the background copy's looping programs (kvcache/prefetch.py)
        copy_chunks(src, torch.where(skip, -1, si), loop, di, kc[0].numel(), programs=16)
        if not torch.equal(loop.view(torch.uint8), dst.view(torch.uint8)):
            raise AssertionError(f"copy_chunks {dtype} with 16 looping programs differs from one program per chunk")
        host = torch.zeros(P * page, Hkv, D, dtype=dtype).pin_memory()
        r = torch.randperm(P * page, device=dev, generator=g)[:5000]
        new = torch.randn(5000, Hkv, D, device=dev, generator=g).to(dtype)
        scatter_rows(host, r, new)
        torch.cuda.synchronize()
        if not torch.equal(host[r.cpu()].view(torch.uint8), new.cpu().view(torch.uint8)):
            raise AssertionError(f"scatter_rows {dtype} not bit-exact")
    _check_graph_replay()
    detail(f"bsa (prefill, decode), paged decode, chunk scores: tiered == one-tier bit for bit ({', '.join(rows)}), "
           "slots of a page and of one KV head's page; copy kernels exact; graph replay follows the page table")


def _check_tiered(kc, vc, kt, vt, tables, L, dtype, units, g, D):
    """bsa (decode and prefill), and in bf16 paged decode and chunk scoring: tiered == one tier, bit for bit. D: the
    head dim (an fp8 cache's rows are wider: D values and their scale)."""
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.paged_decode import paged_decode
    from longreach.kernels.prune_stage import chunk_scores_triton

    dev = "cuda"
    Hq, Hkv = 32, kc.shape[2]
    for decode in (True, False):
        lens_q = [1, 1] if decode else [64, 200]
        ctx = [x - q for x, q in zip(L, lens_q)]
        q = torch.randn(sum(lens_q), Hq, D, device=dev, generator=g, dtype=torch.bfloat16)
        qb = QueryBlocks.build(lens_q, ctx, 1 if decode else 64)
        sels = [torch.stack([torch.randperm(-(-L[qb.seq[b]] // 64), device=dev, generator=g)[:48]
                             for _ in range(Hkv)]) for b in range(qb.num_blocks)]
        blocks, counts = SparseIndex.pack(sels, dev)
        idx = SparseIndex(1 if decode else 64, 64, 256, 1024, Hkv, qb, blocks, counts)
        for splits in ((1, 8) if decode else (1,)):
            a, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits)
            b, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, D ** -0.5, num_splits=splits)
            if not torch.equal(a, b):
                raise AssertionError(f"bsa {dtype} decode={decode} splits={splits}: tiered != one-tier")
        if dtype == torch.bfloat16:
            q = torch.randn(2, Hq, D, device=dev, generator=g, dtype=dtype)
            sl = torch.tensor(L, dtype=torch.int32, device=dev)
            a, _ = paged_decode(q, kc, vc, tables, sl, D ** -0.5, num_splits=16)
            b, _ = paged_decode(q, kt, vt, tables, sl, D ** -0.5, num_splits=16)
            if not torch.equal(a, b):
                raise AssertionError(f"paged decode, units {units}: tiered != one-tier")
            qs = torch.randn(1, Hq, D, device=dev, generator=g, dtype=dtype)
            one = torch.zeros(1, dtype=torch.long, device=dev)
            for exact, chunk in ((False, 64), (True, 32)):
                i2 = torch.arange(0, L[0] // chunk, device=dev, dtype=torch.int32)[None, None].expand(1, Hkv, -1)
                a = chunk_scores_triton(qs, kc, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                b = chunk_scores_triton(qs, kt, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                if not torch.equal(a, b):
                    raise AssertionError(f"chunk scores exact={exact}, units {units}: tiered != one-tier")


def _check_graph_replay():
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import BSAPlan, block_sparse_attention_triton

    dev = "cuda"
    # graph capture: the page table is read at replay
    g = torch.Generator(device=dev).manual_seed(4)
    kc = torch.randn(4000, 16, 8, 128, device=dev, generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kt, vt = two_tier(kc, vc, 0.5, g)
    tables = torch.randperm(4000, device=dev, generator=g).int()[None]
    qb = QueryBlocks.build([1], [64000 - 1], 1)
    sel = [torch.stack([torch.randperm(1000, device=dev, generator=g)[:48] for _ in range(8)])]
    blocks, counts = SparseIndex.pack(sel, dev)
    idx = SparseIndex(1, 64, 256, 1024, 8, qb, blocks, counts)
    q = torch.randn(1, 32, 128, device=dev, generator=g, dtype=torch.bfloat16)
    plan = BSAPlan(idx, 32, 8, dev)  # host-to-device copies are not allowed while capturing
    ref, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    out, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    kt.slots[: 2000] = -1  # evict half the table: those pages now come from the host
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out, ref):
        raise AssertionError("captured tiered bsa differs after the page table changed")


def test_offload_engine(gpu_model, detail):
    """SmolLM2 at 128K tokens with infinitehip: offloaded (GPU pool = 1/8 of the KV) == not offloaded, greedy tokens
    and prompt logits bit for bit, with a slot per page and per KV head's page (the default); hit ratio, installed
    bytes and decode tok/s of each; fp8 offloaded beside them."""
    from longreach import LLM, SamplingParams

    length = 131072
    text = essay_text()
    res = {}
    kv_gb = length * 30 * 3 * 64 * 2 * 2 / 2**30
    for name, kw in (("gpu", {"kv_cache_memory_gb": kv_gb * 1.1 + 0.2}),
                     ("offload", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2,
                                  "kv_offload_unit": "page"}),
                     ("offload-heads", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2,
                                        "kv_offload_unit": "head"}),
                     ("offload-fp8", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2,
                                      "kv_cache_dtype": "fp8"})):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_model, attention="infinitehip", max_model_len=length + 256, max_num_seqs=2,
                  max_num_batched_tokens=16384, **kw)
        tok = llm.get_tokenizer()
        ids = tok.encode(text)
        ids = (ids * (length // len(ids) + 1))[: length - 64] + tok.encode("\nSummarise the text above.")
        p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = out.metrics
        logits = llm.engine.prompt_logits(ids[:20000])[-8:]
        res[name] = dict(tokens=out.token_ids, prefill_s=m.prefill_seconds, tok_s=m.decode_tokens_per_s,
                         wall=wall, hit=m.kv_pages_hit, miss=m.kv_pages_missed, logits=logits.cpu(),
                         stats=llm.engine.kv_cache_stats())
        if name.startswith("offload"):
            llm.engine.kv_cache.check_integrity()
        del llm
    a, b = res["gpu"], res["offload"]
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    if same != len(a["tokens"]) or not torch.equal(a["logits"], b["logits"]):
        raise AssertionError(f"offload differs: {same}/{len(a['tokens'])} tokens equal, logits equal "
                             f"{torch.equal(a['logits'], b['logits'])}")
    hit = b["hit"] / max(1, b["hit"] + b["miss"])
    h = res["offload-heads"]
    h_same = sum(x == y for x, y in zip(a["tokens"], h["tokens"]))
    if h_same != len(a["tokens"]) or not torch.equal(a["logits"], h["logits"]):
        raise AssertionError(f"offload with head slots differs: {h_same}/{len(a['tokens'])} tokens equal")
    h_hit = h["hit"] / max(1, h["hit"] + h["miss"])
    f8 = res["offload-fp8"]
    f8_same = sum(x == y for x, y in zip(a["tokens"], f8["tokens"]))
    detail(f"fp8 offloaded: {f8_same}/{len(a['tokens'])} greedy tokens as bf16, {f8['tok_s']:.1f} tok/s; "
           f"{length} tokens, pool 1/8 of the KV: tokens {same}/{len(a['tokens'])} and logits equal; prefill "
           f"{a['prefill_s']:.2f} s -> {b['prefill_s']:.2f} s, decode {a['tok_s']:.1f} -> {b['tok_s']:.1f} tok/s, "
           f"hit ratio {hit:.3f}, installed {b['stats']['pages_installed']} pages "
           f"({b['stats']['bytes_h2d'] / 1e9:.2f} GB); head slots: equal too, {h['tok_s']:.1f} tok/s, hit ratio "
           f"{h_hit:.3f}, installed {h['stats']['pages_installed']} head-pages ({h['stats']['bytes_h2d'] / 1e9:.2f} GB)")


TINY_LENGTH = 16384
TINY_KV_GB = TINY_LENGTH * 2 * 2 * 2 * 16 * 2 / 2**30  # random:tiny: 2 layers x K, V x 2 KV heads x 16 dims, bf16


def _tiny_offloaded(pool: float) -> dict:
    """LLM arguments: random:tiny's KV offloaded with head slots, a GPU pool of `pool` of it."""
    return {"kv_cache_memory_gb": TINY_KV_GB * pool, "kv_offloading_size": TINY_KV_GB * 1.5 + 0.01,
            "kv_offload_unit": "head"}


def _tiny_greedy(cfg: str, seed: int, steps: int, runs: dict, before=None) -> dict:
    """random:tiny (trained to 4,096 tokens) on a random TINY_LENGTH-token prompt under infinitehip with `cfg`, decoding
    `steps` greedy tokens through CUDA graphs for each of `runs` (name -> LLM arguments; `before(name)` first); each
    offloaded store is checked for consistency after. Returns name -> (tokens, kv_cache_stats, the store's number of
    prefill staging buffers or None)."""
    from longreach import LLM, SamplingParams

    ids = torch.randint(3, 500, (TINY_LENGTH,), generator=torch.Generator().manual_seed(seed)).tolist()
    res = {}
    for name, kw in runs.items():
        if before is not None:
            before(name)
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM("random:tiny", attention="infinitehip", attention_config=cfg, max_model_len=TINY_LENGTH + 128,
                  max_num_batched_tokens=4096, **kw)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)[0]
        kv = llm.engine.kv_cache
        if "kv_offloading_size" in kw:
            kv.check_integrity()
        res[name] = (out.token_ids, llm.engine.kv_cache_stats(), getattr(kv, "staging_buffers", None))
        del llm, kv
    return res


def test_offload_installs_inside_the_step(detail, monkeypatch):
    """No model: random:tiny at 16K with infinitehip's default preset at smaller budgets, decoding through CUDA
    graphs: offloaded with head slots to a pool of 1/8 of the KV, where stage 1's candidates are installed inside the
    step after each stage-0 refresh (`install_reads`, a captured fixed-width clock and copy), gives the GPU-resident
    cache's greedy tokens; early installs happened, and the store is consistent after. Its four 4K prefill chunks
    gather their prefixes into two staging buffers, layer 1's on the copy stream while layer 0 computes
    (kvcache/staging.py): by DMA of page runs, and in a third run by the copy kernel (no runs)."""
    from longreach.kvcache import staging
    from longreach.kvcache.offload import OffloadedKVCache

    steps = 64
    early = []
    end_step = OffloadedKVCache.end_step

    def counted(self):
        early.append(int(self._now[0]))
        return end_step(self)

    def before(name):
        if name == "offload-kernel-gathers":
            monkeypatch.setattr(staging, "MAX_DMA_RUNS", 0)

    monkeypatch.setattr(OffloadedKVCache, "end_step", counted)
    res = _tiny_greedy('{"budgets": [4096, 1024, 256], "dense_below": 0}', 2, steps, {
        "gpu": {"kv_cache_memory_gb": TINY_KV_GB * 1.5 + 0.01},
        "offload-heads": _tiny_offloaded(1 / 8), "offload-kernel-gathers": _tiny_offloaded(1 / 8)}, before)
    (a, _, _), (b, stats, nb), (c, _, nc) = res["gpu"], res["offload-heads"], res["offload-kernel-gathers"]
    same = sum(x == y for x, y in zip(a, b))
    if same != len(a) or sum(early) == 0 or c != a or (nb, nc) != (2, 2):
        raise AssertionError(f"install inside the step: {same}/{len(a)} tokens equal, {sum(early)} early installs; "
                             f"the copy kernel's gathers: tokens equal {c == a}; staging buffers {nb}, {nc} (not 2)")
    detail(f"random:tiny at {TINY_LENGTH} tokens, {steps} greedy tokens equal offloaded (head slots, pool 1/8) and "
           f"not; {sum(early)} head-pages installed inside steps, {stats['pages_installed']} in all, hit ratio "
           f"{stats['pages_hit'] / max(1, stats['pages_hit'] + stats['pages_missed']):.3f}")


def test_offload_installs_ahead(detail):
    """No model: random:tiny at 16K, infinitehip with `ahead` and refresh (16, 4, 1) through CUDA graphs: offloaded
    with head slots to a pool of 1/2 of the KV (1/8 left no slot old enough to reserve: 0 reserved on an H200,
    2026-11-30), stage 0's kept output reserved inside the captured refresh step and
    copied on the copy stream by the looping copy kernel while later steps run (kvcache/prefetch.py), gives the
    GPU-resident cache's greedy tokens with the same config; reservations were copied and activated, and the store
    is consistent after."""
    steps = 96
    cfg = '{"budgets": [4096, 1024, 256], "dense_below": 0, "refresh": [16, 4, 1], "ahead": true}'
    res = _tiny_greedy(cfg, 4, steps, {"gpu": {"kv_cache_memory_gb": TINY_KV_GB * 1.5 + 0.01},
                                       "offload-heads": _tiny_offloaded(1 / 2)})
    (a, _, _), (b, stats, _) = res["gpu"], res["offload-heads"]
    same = sum(x == y for x, y in zip(a, b))
    if same != len(a) or stats["pages_installed_ahead"] == 0:
        raise AssertionError(f"installs ahead: {same}/{len(a)} tokens equal, {stats['pages_installed_ahead']} "
                             "head-pages installed ahead")
    detail(f"random:tiny at {TINY_LENGTH} tokens, ahead + refresh (16, 4, 1): {steps} greedy tokens equal offloaded "
           f"(head slots, pool 1/2) and not; {stats['pages_installed_ahead']} head-pages installed ahead, "
           f"{stats['pages_installed_in_step']} inside steps, {stats['pages_installed']} in all")
