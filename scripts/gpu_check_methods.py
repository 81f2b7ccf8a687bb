"""GPU checks of the methods beyond infinitehip: MInference, the Cascading KV cache, PSA (run from
scripts/gpu_check.py)."""
from __future__ import annotations

import gc
import os
import time

import torch
from gpu_check_common import _inv_freq, _median_us, _rel, _tier

from longreach.rope.strategies import RopeArgs


def minference_matrix():
    """MInference: the range/column kernel vs the PyTorch executor (fp32 math on the same bf16 inputs) at real sizes,
    per head and per KV group, every pattern kind mixed in one layer, a chunk after a long prefix + a whole prompt."""
    from longreach.attention.executor import range_attention
    from longreach.attention.index import QueryBlocks
    from longreach.attention.minference import MInference, MInferenceConfig, index_cost
    from longreach.kernels.vertical_slash import range_attention_triton

    dev = "cuda"
    worst, n, costs = 0.0, 0, []
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64)]:
        for gran in ("head", "kv_head"):
            G = Hq if gran == "head" else Hkv
            mix = [("vertical_slash", 500, 1500), ("a_shape", 1024, 4096), ("block_sparse", 100),
                   ("vertical_slash", 3000, 200)]
            pats = [mix[i % len(mix)] for i in range(G)]
            g = torch.Generator(device=dev).manual_seed(Hq + G)
            lens_ctx, lens_q = [40000, 0], [2048 + 37, 9000]
            L = [c + q for c, q in zip(lens_ctx, lens_q)]
            page = 16
            need = [-(-x // page) for x in L]
            kc = torch.randn(sum(need) + 4, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            perm = torch.randperm(kc.shape[0], device=dev, generator=g).int()
            tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
            tables[0, : need[0]], tables[1, : need[1]] = perm[: need[0]], perm[need[0]: need[0] + need[1]]
            q = torch.randn(sum(lens_q), Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            m = MInference(MInferenceConfig(granularity=gran), Hq, Hkv)
            qb = QueryBlocks.build(lens_q, lens_ctx, 64)
            tiles, cols, row0 = [], [], 0
            for i, nq in enumerate(lens_q):
                blocks = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
                t, c = m.build(0, q[row0:row0 + nq], blocks, (kc, tables[i]), L[i], D ** -0.5, patterns=pats)
                tiles.append(t)
                cols.append(c)
                row0 += nq
            idx = m.index(qb, tiles, cols)
            ref, _ = range_attention(q, kc, vc, tables, idx, D ** -0.5)
            out = torch.full_like(q, float("nan"))
            range_attention_triton(q, kc, vc, tables, idx, D ** -0.5, out=out)
            err = _rel(out, ref)
            n += 1
            costs.append(index_cost(idx))
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} granularity={gran}: rel err {err:.2e}")
            worst = max(worst, err)
    return (f"{n} cases (per head / per KV group, Λ + vertical-slash + block-sparse in one layer), worst relative "
            f"error {worst:.2e} vs fp32 reference; kernel keys/row {min(costs):.0f}-{max(costs):.0f}")


def minference_engine(model: str):
    """minference end to end: kernels vs the CPU reference (greedy tokens), and minference prefill + infinitehip
    decode with CUDA graphs == eager."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    conf = '{"pattern": ["vertical_slash", 64, 512], "dense_below": 0}'
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="minference", attention_config=conf, device=device, dtype=dtype,
                  max_model_len=4096, kv_cache_memory_gb=1, max_num_seqs=1)
        ids = llm.get_tokenizer().encode(text)[:3000]
        outs.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    same = sum(a == b for a, b in zip(*outs))
    if same < 20:
        raise AssertionError(f"minference: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    composed = []
    for eager in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="minference", attention_config=conf, decode_attention="infinitehip",
                  max_model_len=16384, kv_cache_memory_gb=2, max_num_seqs=4, enforce_eager=eager)
        ids = llm.get_tokenizer().encode(text)[:12000]
        composed.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    if composed[0] != composed[1]:
        raise AssertionError("minference + infinitehip decode: CUDA-graph tokens differ from eager")
    return f"kernels vs CPU reference {same}/24 tokens; minference + infinitehip decode at 12K: graph == eager"


def cascading_kernels():
    """Cascading: the block-sparse kernel with RoPE strategy "cache" over one-token pages (a virtual sequence: sink,
    cached tokens, chunk) and the key-mass kernel vs their PyTorch references, bf16 inputs, real sizes."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.key_mass import key_mass_reference, key_mass_triton

    dev = "cuda"
    worst_o, worst_m, n = 0.0, 0.0, 0
    for (Hq, Hkv, D) in [(9, 3, 64), (32, 8, 128)]:
        for rows, cached, B in [(1024, 16384 + 64, 1), (1, 65536 + 64, 4)]:
            g = torch.Generator(device=dev).manual_seed(Hq + rows)
            V = cached + rows
            nslots = B * V + 7
            kc = torch.randn(nslots, 1, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            table = torch.randperm(nslots, device=dev, generator=g)[: B * V].view(B, V).int()
            q = torch.randn(B * rows, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            bq, S, BK = (64 if rows > 1 else 1), 64, 64
            qb = QueryBlocks.build([rows] * B, [cached] * B, bq)
            sel = [torch.arange(S // BK, max(S // BK, (p + ln - 1 - 64) // BK + 1), device=dev)[None]
                   for p, ln in zip(qb.pos, qb.length)]
            blocks, counts = SparseIndex.pack(sel, dev)
            idx = SparseIndex(bq, BK, S, 64, 1, qb, blocks, counts)
            rope = RopeArgs("cache", _inv_freq(D), 0)
            ref, lse_ref = block_sparse_attention(q, kc, vc, table, idx, D ** -0.5, rope=rope)
            out = torch.full_like(q, float("nan"))
            splits = 1 if rows > 1 else 16
            block_sparse_attention_triton(q, kc, vc, table, idx, D ** -0.5, num_splits=splits, rope=rope, out=out)
            worst_o = max(worst_o, _rel(out, ref))
            args = (q, kc, table, torch.arange(B, device=dev) * rows, torch.full((B,), rows, device=dev),
                    torch.full((B,), cached, device=dev), torch.full((B,), V, device=dev), lse_ref,
                    torch.rand(B * rows, device=dev, generator=g), D ** -0.5, rope)
            mref = key_mass_reference(*args)
            mgot = key_mass_triton(*args)
            worst_m = max(worst_m, _rel(mgot, mref))
            n += 1
            if torch.isnan(out).any() or worst_o > 2e-2 or worst_m > 2e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} rows={rows} keys={V}: attention rel err {worst_o:.2e}, "
                                     f"key mass rel err {worst_m:.2e}")
    return f"{n} cases (prefill 1024 rows x 17K keys, decode x4 over 65K), worst rel err attention {worst_o:.2e}, " \
           f"key mass {worst_m:.2e} (bf16 vs fp32 reference)"


CASCADE_SMALL = '{"n_sink": 64, "num_subcaches": 4, "subcache_size": 256, "stride": 512}'  # 1,088 tokens: drops


def cascading_engine(model: str):
    """Cascading through the engine on the GPU (Triton kernels) vs the CPU reference path: a 3K-token prompt with a
    1,088-token cache (hundreds of drops), 24 greedy tokens."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    outs = []
    for device in ("cuda", "cpu"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="cascading", attention_config=CASCADE_SMALL, device=device, dtype="float32",
                  max_model_len=4096, max_num_seqs=1, kv_cache_memory_gb=1)
        ids = llm.get_tokenizer().encode(text)[:3000]
        outs.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True), use_tqdm=False)[0])
        llm.engine.backend.check_integrity()
        del llm
    same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
    if same < 20:
        raise AssertionError(f"cascading: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    return f"GPU kernels vs CPU reference, fp32, {same}/24 greedy tokens equal"


def cascading_passkey(model: str, lengths=(8192, 16384, 32768, 65536), depths=(0.05, 0.25, 0.5, 0.75, 0.95),
                      seeds=2):
    """Passkey: cascading `4k` (64 sink + 4 x 1008) vs streaming with the same memory (64 sink + 4032 window) at
    growing lengths, every depth (the blog's experiment at SmolLM2's scale; the blog: 65K cache to 1M on a larger
    model). Reports accuracy per length and depth and prefill seconds; quality is measured, not asserted."""
    from longreach import LLM, SamplingParams
    from longreach.eval.passkey import passkey_prompt, score

    rows = {}
    for name, conf in (("cascading:4k", ("cascading", None)),
                       ("streaming:4096", ("streaming", '{"n_sink": 64, "n_window": 4032}'))):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention=conf[0], preset="4k" if conf[0] == "cascading" else None, attention_config=conf[1],
                  max_model_len=max(lengths) + 16, max_num_seqs=4, kv_cache_memory_gb=8 if conf[0] == "streaming"
                  else 2, max_num_batched_tokens=8192)
        tok = llm.get_tokenizer()
        acc, secs = {}, {}
        for n in lengths:
            t0 = time.perf_counter()
            for d in depths:
                prompts, keys = [], []
                for s in range(seeds):
                    ids, key = passkey_prompt(tok, n, d, s)
                    prompts.append({"prompt_token_ids": ids})
                    keys.append(key)
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
                acc[(n, d)] = sum(score(o.text, k) for o, k in zip(outs, keys)) / seeds
            secs[n] = round((time.perf_counter() - t0) / (len(depths) * seeds), 2)
        rows[name] = (acc, secs)
        del llm
    lines = []
    for name, (acc, secs) in rows.items():
        per_len = ", ".join(f"{n // 1024}K " + "/".join(f"{acc[(n, d)]:.1f}" for d in depths) +
                            f" ({secs[n]} s)" for n in lengths)
        lines.append(f"{name}: {per_len}")
    return f"depths {list(depths)}, {seeds} keys per cell: " + "; ".join(lines)


def cascading_prefill(model: str, lengths=(131072, 1048576)):
    """Prefill time of cascading `16k` (64 sink + 8 x 2040, stride 4096) through the engine vs dense (cuDNN) at the
    lengths where its KV fits, SmolLM2; the blog: 15% of FlashAttention's time at 1M with a 16K cache (A6000)."""
    from longreach import LLM, SamplingParams

    res = []
    for name in ("cascading", "dense"):
        for n in lengths:
            if name == "dense" and n > 262144:
                continue  # 1M dense: ~23 GB of KV and minutes; extrapolated from 128K below
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(model, attention=name, preset="16k" if name == "cascading" else None, max_model_len=n + 16,
                      max_num_seqs=1, max_num_batched_tokens=8192,
                      kv_cache_memory_gb=2 if name == "cascading" else n * 23040 / 2**30 * 1.1 + 0.5)
            ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
            out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            res.append((name, n, out[0].metrics.prefill_seconds))
            print(f"  cascading_prefill: {name} {n // 1024}K prefill {res[-1][2]:.1f} s", flush=True)  # if cut off
            del llm
    t = {(a, n): s for a, n, s in res}
    dense128 = t.get(("dense", 131072))
    extra = f"; dense at 1M extrapolated x64 from 128K: {dense128 * 64:.0f} s" if dense128 else ""
    return ", ".join(f"{a} {n // 1024}K {s:.1f} s" for a, n, s in res) + extra


def _random_paged(dev, g, lengths, page: int, Hkv: int, D: int, dtype):
    """Random K/V for sequences of `lengths`, their pages scattered through a pool (two spare pages) by a random block
    table: (tables, seq_lens, kc, vc)."""
    need = [-(-x // page) for x in lengths]
    P = sum(need) + 2
    perm = torch.randperm(P, device=dev, generator=g).int()
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=dev)
    o = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[o:o + k]
        o += k
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    kc = torch.randn(P, page, Hkv, D, device=dev, generator=g, dtype=dtype)
    vc = torch.randn(P, page, Hkv, D, device=dev, generator=g, dtype=dtype)
    return tables, seq_lens, kc, vc


def psa_matrix(dev: str = "cuda", lengths=(131072 + 5, 40000, 777), shape=(32, 8, 128), pages=(16, 32),
               dtype=torch.bfloat16, timing: bool = True):
    """PSA at Llama-8B's shape and 128K (attention/psa.py): the metadata, scoring and both decode kernels (loop and
    waves, kernels/psa_decode.py) against their PyTorch references (fp32 math on the same bf16 inputs), one tier,
    two tiers (pinned host pages over UVA) and fp8 rows; the decode step captured in a CUDA graph == eager, with
    either kernel; and the time of one decode step (rank + loop) next to the dense paged-decode kernel, with the keys
    it read, and of the two decode kernels alone (CUDA graphs, batch 1). (The defaults are the GPU run; a CPU smoke
    run shrinks them.)"""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.block_meta import (block_scores_reference, block_scores_triton,
                                              build_block_meta_reference, build_block_meta_triton)
    from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves
    from longreach.kvcache.fp8 import encode

    Hq, Hkv, D = shape
    kernels = {"loop": psa_decode_triton, "waves": psa_decode_waves}
    notes, pairs, disagree = [], 0, 0
    worst, mismatched = dict.fromkeys(kernels, 0.0), dict.fromkeys(kernels, 0)

    def captured(fn):
        """fn captured in a CUDA graph: (graph, the outputs its replays write)."""
        fn()  # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn()
        return graph, outs

    for page in pages:
        g = torch.Generator(device=dev).manual_seed(page)
        tables, seq_lens, kc, vc = _random_paged(dev, g, lengths, page, Hkv, D, dtype)
        need, P = [-(-x // page) for x in lengths], kc.shape[0]
        q = torch.randn(len(lengths), Hq, D, device=dev, generator=g, dtype=dtype)
        u = torch.randn(Hkv, D, device=dev, generator=g, dtype=dtype)
        q += u.repeat_interleave(Hq // Hkv, 0)  # some structure: a shared direction and a few hot blocks
        hot = tables[0, torch.randint(8, need[0] * 3 // 4, (64,), device=dev, generator=g)].long()
        kc[hot] += u * 1.5
        lo = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
        hi = ((seq_lens - 1) // page).int()
        meta = torch.zeros(P, 2, Hkv, D, dtype=dtype, device=dev)
        build_block_meta_triton(kc, tables, lo, hi, int(hi.max()), meta, "cuboid-mean")
        ref_meta = torch.zeros(P, 2, Hkv, D, dtype=torch.float32, device=dev)
        build_block_meta_reference(kc, tables, lo, hi, ref_meta, "cuboid-mean")
        err = _rel(meta.float(), ref_meta)
        if err > 1e-2:
            raise AssertionError(f"page {page}: block metadata rel err {err:.2e}")
        methods = {name: PSA(PSAConfig(n_sink=64, n_window=128, decode_kernel=name), Hq, Hkv) for name in kernels}
        m = methods["loop"]
        cand_lo, cand_hi = m.candidates(seq_lens, page)
        W = tables.shape[1]
        scores = block_scores_triton(q, meta, tables, cand_lo, cand_hi, W)
        ref_scores = block_scores_reference(q, meta, tables, cand_lo, cand_hi, W)
        fin = torch.isfinite(ref_scores)
        if not torch.equal(fin, torch.isfinite(scores)) or _rel(scores[fin], ref_scores[fin]) > 1e-3:
            raise AssertionError(f"page {page}: block scores differ from the reference")
        ranked = scores.sort(dim=-1, descending=True, stable=True).indices.int()
        scale = D ** -0.5
        caches = {"one tier": (kc, vc)}
        if dev == "cuda":
            caches["two tiers"] = tuple(_tier(kc, vc, 0.3, g))
        f8 = (encode(kc, torch.float8_e4m3fn), encode(vc, torch.float8_e4m3fn))
        for eps in (0.9, 0.95, 1.0):
            args = (tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
            _, _, ref_counts = psa_decode_reference(q, kc, vc, *args)
            forced = {}  # (fp8, counts) -> the reference made to read those blocks (the kernels mostly agree)

            def reference_on(reads, fp8=False):
                key = (fp8, reads.cpu().numpy().tobytes())
                if key not in forced:
                    forced[key] = psa_decode_reference(q, *(f8 if fp8 else (kc, vc)), *args, counts=reads)[0]
                return forced[key]
            reads = {}
            for name, run in kernels.items():
                out, _, counts = run(q, kc, vc, *args)
                reads[name] = counts
                # a threshold crossing within fp rounding may flip a (row, group): compare outputs on the kernel's reads
                mismatched[name] += int((counts != ref_counts).sum())
                err = _rel(out, reference_on(counts))
                worst[name] = max(worst[name], err)
                if torch.isnan(out).any() or err > 1e-2:
                    raise AssertionError(f"{name} kernel, page {page} eps {eps}: rel err {err:.2e} vs the reference")
                if eps == 1.0 and not torch.equal(counts.long(),
                                                  (cand_hi.long() - cand_lo)[:, None].expand_as(counts)):
                    raise AssertionError(f"{name} kernel: epsilon 1 must read every candidate block")
                for cache, (kk, vv) in caches.items():
                    if cache != "one tier":
                        o2, _, c2 = run(q, kk, vv, *args)
                        if not (torch.equal(o2, out) and torch.equal(c2, counts)):
                            raise AssertionError(f"{name} kernel, page {page} eps {eps}: {cache} != one tier")
                o8, _, c8 = run(q, *f8, *args)
                if _rel(o8, reference_on(c8, True)) > 1e-2:
                    raise AssertionError(f"{name} kernel, page {page} eps {eps}: fp8 rel err "
                                         f"{_rel(o8, reference_on(c8, True)):.2e}")
            pairs += ref_counts.numel()
            disagree += int((reads["loop"] != reads["waves"]).sum())
            if eps == 0.95:
                keys = (reads["loop"].float() * page).mean().item()
                notes.append(f"page {page}: eps 0.95 reads {keys:.0f} ranked keys per (row, KV head) of "
                             f"{(cand_hi.float() - cand_lo).mean().item() * page:.0f}")
        if dev == "cuda":  # the decode step (scores, sort, loop or waves) in a CUDA graph, replayed on new queries
            for name, method in methods.items():
                graph, outs = captured(lambda: method.attend(q, kc, vc, tables, seq_lens, meta, W, scale, True)[:2])
                q.mul_(-1.0)
                graph.replay()
                torch.cuda.synchronize()
                again = method.attend(q, kc, vc, tables, seq_lens, meta, W, scale, True)[:2]
                if not (torch.equal(outs[0], again[0]) and torch.equal(outs[1], again[1])):
                    raise AssertionError(f"page {page}, {name} kernel: graph replay differs from eager after the "
                                         "query changed")
                q.mul_(-1.0)
            if timing:
                from longreach.kernels.paged_decode import paged_decode

                one = slice(0, 1)  # batch 1 at 128K
                step = (q[one], kc, vc, tables[one], seq_lens[one], meta, W, scale, True)
                t_psa = _median_us(lambda: m.attend(*step))
                t_dense = _median_us(lambda: paged_decode(q[one], kc, vc, tables[one], seq_lens[one], scale,
                                                          num_splits=32))
                notes.append(f"page {page}, batch 1 at {lengths[0]}: psa decode step {t_psa:.0f} us (scores + sort "
                             f"+ loop), dense paged decode {t_dense:.0f} us")
                dec = (q[one], kc, vc, tables[one], seq_lens[one], ranked[one], cand_lo, cand_hi[one], 0.95, 4, scale)
                t = {name: _median_us(captured(lambda run=run: run(*dec))[0].replay) for name, run in kernels.items()}
                read = psa_decode_waves(*dec)[2]
                fixed = cand_lo * page + lengths[0] - int(cand_hi[0]) * page  # sink + tail keys per KV head
                gb = (read.sum().item() * page + fixed * Hkv) * D * 2 * kc.element_size() / 1e9
                notes.append(f"decode kernel alone (eps 0.95, CUDA graph): loop {t['loop']:.0f} us, waves "
                             f"{t['waves']:.0f} us ({gb * 1e3:.0f} MB of K/V, {gb / t['waves'] * 1e6:.0f} GB/s); "
                             f"loop / waves = {t['loop'] / t['waves']:.2f}x")
    for name, bad in mismatched.items():
        if bad > 0.01 * pairs:
            raise AssertionError(f"{name} kernel: blocks read differ from the reference in {bad}/{pairs} pairs")
    if disagree > 0.01 * pairs:
        raise AssertionError(f"waves and loop kernels read different blocks in {disagree}/{pairs} pairs")
    gpu_only = "; tiered == one tier; graph replay == eager" if dev == "cuda" else " (CPU smoke run: no tiers, graph)"
    return (f"kernels == references (worst output rel err loop {worst['loop']:.2e} / waves {worst['waves']:.2e}, "
            f"reads equal in {pairs - mismatched['loop']} / {pairs - mismatched['waves']} of {pairs} pairs; "
            f"waves == loop reads in {pairs - disagree}/{pairs}); fp8{gpu_only}. " + "; ".join(notes))


def psa_step_times(dev: str = "cuda", lengths=(131072 + 5, 1048576 + 5), shape=(32, 8, 128), page: int = 16,
                   dtype=torch.bfloat16) -> str:
    """Where a PSA decode step's time goes, every part captured in a CUDA graph and timed by its replays (batch 1,
    8B shape, random keys with a few hot blocks, eps 0.95): block scores, the stable sort, the loop and waves
    kernels alone, the whole step (`PSA.attend`) with either kernel, and dense paged decode over the same cache.
    The width is the engine's: the graph bucket (a power of two >= the length) in pages. psa_matrix checks the
    results; this only times them."""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.block_meta import block_scores_triton, build_block_meta_triton
    from longreach.kernels.paged_decode import default_num_splits, paged_decode
    from longreach.kernels.psa_decode import psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves

    Hq, Hkv, D = shape
    rows = []

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return _median_us(graph.replay)

    for length in lengths:
        g = torch.Generator(device=dev).manual_seed(length)
        need = -(-length // page)
        width = -(-(1 << (length - 1).bit_length()) // page)  # the graph bucket's blocks
        tables = torch.zeros(1, width, dtype=torch.int32, device=dev)
        tables[0, :need] = torch.randperm(need, device=dev, generator=g).int()
        seq_lens = torch.tensor([length], dtype=torch.int32, device=dev)
        kc = torch.randn(need, page, Hkv, D, device=dev, generator=g, dtype=dtype)
        vc = torch.randn(need, page, Hkv, D, device=dev, generator=g, dtype=dtype)
        q = torch.randn(1, Hq, D, device=dev, generator=g, dtype=dtype)
        u = torch.randn(Hkv, D, device=dev, generator=g, dtype=dtype)
        q += u.repeat_interleave(Hq // Hkv, 0)
        kc[tables[0, torch.randint(8, need * 3 // 4, (64,), device=dev, generator=g)].long()] += u * 1.5
        meta = torch.zeros(need, 2, Hkv, D, dtype=dtype, device=dev)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        build_block_meta_triton(kc, tables, zero, ((seq_lens - 1) // page).int(), need, meta, "cuboid-mean")
        scale = D ** -0.5
        methods = {k: PSA(PSAConfig(decode_kernel=k), Hq, Hkv) for k in ("loop", "waves")}
        m = methods["loop"]
        cand_lo, cand_hi = m.candidates(seq_lens, page)
        splits = default_num_splits(1, Hkv, length)
        t_dense = timed(lambda: paged_decode(q, kc, vc, tables, seq_lens, scale, num_splits=splits))
        # "hot": a shared direction and hot blocks; "flat": q scaled down, attention near uniform (as with random
        # weights), so the stop rule reads ~eps of the candidates
        for case, qq in (("hot", q), ("flat", q * 0.01)):
            scores = block_scores_triton(qq, meta, tables, cand_lo, cand_hi, width)
            ranked = scores.sort(dim=-1, descending=True, stable=True).indices.int()
            t = {"scores": timed(lambda: block_scores_triton(qq, meta, tables, cand_lo, cand_hi, width)),
                 "sort": timed(lambda: scores.sort(dim=-1, descending=True, stable=True).indices.int())}
            dec = (qq, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, 0.95, 4, scale)
            t["loop"] = timed(lambda: psa_decode_triton(*dec))
            t["waves"] = timed(lambda: psa_decode_waves(*dec))
            for name, method in methods.items():
                t[f"step({name})"] = timed(lambda method=method: method.attend(qq, kc, vc, tables, seq_lens, meta,
                                                                               width, scale, True))
            t["dense"] = t_dense
            keys = (psa_decode_waves(*dec)[2].float() * page).mean().item()
            rows.append(f"{length} {case}: " + ", ".join(f"{k} {v:.0f}" for k, v in t.items())
                        + f" us; dense / step(waves) = {t['dense'] / t['step(waves)']:.2f}x; {keys:.0f} ranked keys "
                        f"read per KV head of {(int(cand_hi) - cand_lo) * page}")
            print(rows[-1], flush=True)
    return "; ".join(rows)


def psa_rank_rope(dev: str = "cuda", lengths=(131072 + 5, 40000, 777), shape=(32, 8, 128), page: int = 16,
                  rope_from: int = 8192, dtype=torch.bfloat16) -> str:
    """PSA's `rope: rank` positions in bf16 at the 8B shape: the moved-key metadata kernel and both decode kernels
    against their PyTorch references (fp32 math on the same bf16 inputs); rows past and before rope_from."""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.block_meta import (block_scores_triton, build_block_meta_reference,
                                              build_block_meta_triton)
    from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves

    Hq, Hkv, D = shape
    g = torch.Generator(device=dev).manual_seed(11)
    tables, seq_lens, kc, vc = _random_paged(dev, g, lengths, page, Hkv, D, dtype)
    P = kc.shape[0]
    q = torch.randn(len(lengths), Hq, D, device=dev, generator=g, dtype=dtype)
    inv = _inv_freq(D).float()
    lo = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
    hi = ((seq_lens - 1) // page).int()
    meta = torch.zeros(P, 2, Hkv, D, dtype=dtype, device=dev)
    build_block_meta_triton(kc, tables, lo, hi, int(hi.max()), meta, "cuboid-mean", inv)
    ref_meta = torch.zeros(P, 2, Hkv, D, dtype=torch.float32, device=dev)
    build_block_meta_reference(kc, tables, lo, hi, ref_meta, "cuboid-mean", inv)
    built = torch.cat([tables[i, :int(hi[i])] for i in range(len(lengths))]).long()
    err_meta = _rel(meta[built].float(), ref_meta[built])
    if err_meta > 1e-2:
        raise AssertionError(f"moved metadata rel err {err_meta:.2e}")
    m = PSA(PSAConfig(), Hq, Hkv)
    cand_lo, cand_hi = m.candidates(seq_lens, page)
    ranked = block_scores_triton(q, meta, tables, cand_lo, cand_hi, tables.shape[1]).sort(
        dim=-1, descending=True, stable=True).indices.int()
    rope, notes, scale = (inv, rope_from), [], D ** -0.5
    for eps in (0.9, 0.95):
        args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
        _, _, ref_counts = psa_decode_reference(*args, rope=rope)
        for name, run in (("loop", psa_decode_triton), ("waves", psa_decode_waves)):
            out, _, counts = run(*args, rope=rope)
            forced = psa_decode_reference(*args, counts=counts, rope=rope)[0]
            err = _rel(out, forced)
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"{name}, eps {eps}: rel err {err:.2e} against the reference on its reads")
            agree = int((counts == ref_counts).sum())
            if agree < 0.95 * counts.numel():
                raise AssertionError(f"{name}, eps {eps}: reads equal the reference in {agree}/{counts.numel()}")
            notes.append(f"{name} eps {eps}: rel err {err:.1e}, reads equal {agree}/{counts.numel()}")
    return f"moved metadata rel err {err_meta:.1e}; " + "; ".join(notes)
