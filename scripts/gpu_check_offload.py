"""GPU checks of KV offloading and of the fused decode-step kernels (run from scripts/gpu_check.py)."""
from __future__ import annotations

import gc
import os
import time

import torch
from gpu_check_common import _tier


def offload_kernels():
    """Every kernel reading through the page table (resident slots + pinned host pages over UVA) gives bit-identical
    results to the same kernel on the one-tier cache; the copy kernels are bit-exact; a captured graph reads the
    page table's current contents at replay."""
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import BSAPlan, block_sparse_attention_triton
    from longreach.kernels.offload_copy import copy_chunks, scatter_rows
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.kvcache.fp8 import encode

    dev = "cuda"
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        g = torch.Generator(device=dev).manual_seed(3)
        Hq, Hkv, D, page = 32, 8, 128, 16
        L = [131072 + 5, 40000]
        need = [-(-x // page) for x in L]
        P = sum(need) + 2
        # fp8 caches hold rows of D values + their scale (kvcache/fp8.py): encode() writes that format
        kc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        vc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        perm = torch.randperm(P, device=dev, generator=g).int()
        tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
        tables[0, :need[0]], tables[1, :need[1]] = perm[:need[0]], perm[need[0]:need[0] + need[1]]
        kt, vt = _tier(kc, vc, 0.3, g)
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
            from longreach.kernels.paged_decode import paged_decode

            q = torch.randn(2, Hq, D, device=dev, generator=g, dtype=dtype)
            sl = torch.tensor(L, dtype=torch.int32, device=dev)
            a, _ = paged_decode(q, kc, vc, tables, sl, D ** -0.5, num_splits=16)
            b, _ = paged_decode(q, kt, vt, tables, sl, D ** -0.5, num_splits=16)
            if not torch.equal(a, b):
                raise AssertionError("paged decode: tiered != one-tier")
            ids = torch.arange(0, L[0] // 64, device=dev, dtype=torch.int32)[None, None].expand(1, Hkv, -1)
            qs = torch.randn(1, Hq, D, device=dev, generator=g, dtype=dtype)
            one = torch.zeros(1, dtype=torch.long, device=dev)
            for exact, chunk in ((False, 64), (True, 32)):
                i2 = ids if not exact else torch.arange(0, L[0] // 32, device=dev, dtype=torch.int32)[None, None].expand(
                    1, Hkv, -1)
                a = chunk_scores_triton(qs, kc, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                b = chunk_scores_triton(qs, kt, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                if not torch.equal(a, b):
                    raise AssertionError(f"chunk scores exact={exact}: tiered != one-tier")
        # copy kernels: host pages -> GPU, GPU rows -> host
        src = kc.cpu().pin_memory()
        si = torch.randperm(P, device=dev, generator=g)[:4096]
        di = torch.randperm(P, device=dev, generator=g)[:4096]
        dst = torch.zeros_like(kc)
        copy_chunks(src, si, dst, di, kc[0].numel())
        if not torch.equal(dst[di].view(torch.uint8), kc[si].view(torch.uint8)):
            raise AssertionError(f"copy_chunks {dtype} not bit-exact")
        host = torch.zeros(P * page, Hkv, D, dtype=dtype).pin_memory()
        r = torch.randperm(P * page, device=dev, generator=g)[:5000]
        new = torch.randn(5000, Hkv, D, device=dev, generator=g).to(dtype)
        scatter_rows(host, r, new)
        torch.cuda.synchronize()
        if not torch.equal(host[r.cpu()].view(torch.uint8), new.cpu().view(torch.uint8)):
            raise AssertionError(f"scatter_rows {dtype} not bit-exact")
        rows.append(str(dtype).replace("torch.", ""))
    # graph capture: the page table is read at replay
    g = torch.Generator(device=dev).manual_seed(4)
    kc = torch.randn(4000, 16, 8, 128, device=dev, generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kt, vt = _tier(kc, vc, 0.5, g)
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
    return f"bsa (prefill, decode), paged decode, chunk scores: tiered == one-tier bit for bit ({', '.join(rows)}); " \
           "copy kernels exact; graph replay follows the page table"


def fused_kernels():
    """kernels/fused.py and kernels/kv_store.py at Llama-8B sizes in bf16 against the PyTorch code they replace:
    the residual sums bit for bit, RoPE, RMSNorm and SiLU * up within one bf16 unit (the share of elements that
    differ at all is reported: the first H100 run found RoPE not bit-exact at T=1); the KV
    write (one tier bf16 / fp8, two tiers with pinned host pages over UVA) byte for byte with the CPU path."""
    from longreach.kernels import fused
    from longreach.kvcache.fp8 import FP8
    from longreach.kvcache.offload import OffloadedKVCache
    from longreach.kvcache.paged import PagedKVCache

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(11)
    worst = {}
    for T in (1, 7, 4096):
        x = torch.randn(T, 4096, device=dev, generator=g).to(bf)
        r = torch.randn(T, 4096, device=dev, generator=g).to(bf)
        w = (1 + 0.1 * torch.randn(4096, device=dev, generator=g)).to(bf)
        out, s = fused.add_rms_norm(x, r, w, 1e-5)
        ref, s_ref = fused.add_rms_norm_reference(x, r, w, 1e-5)
        if not torch.equal(s, s_ref):
            raise AssertionError(f"add_rms_norm T={T}: residual sum differs")
        gu = (torch.randn(T, 2 * 14336, device=dev, generator=g) * 3).to(bf)
        for name, a, b in (("rms_norm", out, ref), ("silu_mul", fused.silu_mul(gu), fused.silu_mul_reference(gu))):
            diff = (a.float() - b.float()).abs()
            ulp = torch.finfo(bf).eps * b.float().abs()
            if bool((diff > 1.01 * ulp + 1e-30).any()):
                raise AssertionError(f"{name} T={T}: beyond one bf16 unit, max |diff| {diff.max():.3g}")
            worst[name] = max(worst.get(name, 0.0), (diff > 0).float().mean().item())
        qkv = torch.randn(T, 48 * 128, device=dev, generator=g).to(bf)
        pos = torch.randint(0, 1 << 20, (T,), device=dev, generator=g).float()
        ang = pos[:, None] * (500000.0 ** (-torch.arange(0, 128, 2, device=dev).float() / 128))[None]
        cos, sin = ang.cos().to(bf), ang.sin().to(bf)
        qk = qkv[:, :40 * 128].view(T, 40, 128)
        ref = fused.rope_reference(qk.clone(), cos, sin)
        fused.rope_qk_(qk, cos, sin)
        diff = (qk.float() - ref.float()).abs()
        if bool((diff > 1.01 * torch.finfo(bf).eps * ref.float().abs() + 1e-30).any()):
            raise AssertionError(f"rope T={T}: beyond one bf16 unit, max |diff| {diff.max():.3g}")
        worst["rope"] = max(worst.get("rope", 0.0), (diff > 0).float().mean().item())
    # the KV write: the kernel on the GPU vs the PyTorch path on CPU copies
    L, P, S, bs, H, D, T = 2, 300, 40, 16, 8, 128, 1000
    qkv = torch.randn(T, 48 * 128, device=dev, generator=g).to(bf)
    k, v = qkv[:, 32 * 128:40 * 128].view(T, H, D), qkv[:, 40 * 128:].view(T, H, D)
    slots = torch.randperm(P * bs, device=dev, generator=g)[:T]
    for cdt in (bf, FP8):
        gpu = PagedKVCache(L, P, bs, H, D, cdt, torch.device(dev))
        cpu = PagedKVCache(L, P, bs, H, D, cdt, torch.device("cpu"))
        gpu.kv.view(torch.uint8).fill_(3)
        cpu.kv.view(torch.uint8).fill_(3)
        gpu.store(1, k, v, slots)
        cpu.store(1, k.cpu(), v.cpu(), slots.cpu())
        if not torch.equal(gpu.kv.cpu().view(torch.uint8), cpu.kv.view(torch.uint8)):
            raise AssertionError(f"one-tier KV write {cdt}: bytes differ from the PyTorch path")
        off = OffloadedKVCache(L, P, S, bs, H, D, cdt, torch.device(dev))
        ref = OffloadedKVCache(L, P, S, bs, H, D, cdt, torch.device("cpu"))
        res = torch.randperm(P, device=dev, generator=g)[:S]
        for c in (off, ref):
            c.host.view(torch.uint8).fill_(5)
            c.slot_of[1, res.to(c.slot_of.device)] = torch.arange(S, dtype=torch.int32, device=c.slot_of.device)
        off.store(1, k, v, slots)
        ref.store(1, k.cpu(), v.cpu(), slots.cpu())
        torch.cuda.synchronize()
        if not torch.equal(off.host.view(torch.uint8), ref.host.view(torch.uint8)):
            raise AssertionError(f"two-tier KV write {cdt}: host bytes differ")
        if not torch.equal(off.pool[:S].cpu().view(torch.uint8), ref.pool[:S].view(torch.uint8)):
            raise AssertionError(f"two-tier KV write {cdt}: resident slots differ")
    # marking the pages a decode step reads: the GPU kernel vs the PyTorch path on CPU copies
    L, P, W, nb, G, K = 6, 70000, 65536, 64, 8, 256  # 6 layers: two 32-layer host tiers would need 73 GB of RAM
    tables = torch.randint(0, P - 1, (2, W), device=dev, generator=g, dtype=torch.int32)
    seq = torch.randint(0, 2, (nb,), device=dev, generator=g)
    last = torch.randint(0, W * 16, (nb,), device=dev, generator=g)
    blocks = torch.randint(-1, W * 2, (nb, G, K), device=dev, generator=g, dtype=torch.int32)
    gpu = OffloadedKVCache(L, P, 8, 16, 8, 128, bf, torch.device(dev))
    cpu = OffloadedKVCache(L, P, 8, 16, 8, 128, bf, torch.device("cpu"))
    for st, d in ((gpu, dev), (cpu, "cpu")):
        st.note_reads(5, tables.to(d), seq.to(d), last.to(d), last.to(d), 1, blocks.to(d), 8, 64, 1024)
    want = cpu.wanted.clone()
    want[-1] = False
    if not torch.equal(gpu.wanted.cpu(), want):
        raise AssertionError("note_reads: the GPU kernel marks other pages than the PyTorch path")
    return (f"residual sums bit-exact; RoPE / RMSNorm / SiLU*up differ from PyTorch (by one bf16 unit at most) on "
            f"{100 * worst['rope']:.3f}% / {100 * worst['rms_norm']:.2f}% / {100 * worst['silu_mul']:.2f}% of "
            "elements; KV write bf16 and fp8, "
            "one and two tiers, byte-equal to the PyTorch path; note_reads marks the same pages")


def offload_engine(model: str, length: int = 131072):
    """SmolLM2 at `length` with infinitehip: offloaded (GPU pool = 1/8 of the KV) == not offloaded, greedy tokens and
    prompt logits bit for bit; hit ratio and decode tok/s of both."""
    from longreach import LLM, SamplingParams
    from longreach.tools.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    res = {}
    kv_gb = length * 30 * 3 * 64 * 2 * 2 / 2**30
    for name, kw in (("gpu", {"kv_cache_memory_gb": kv_gb * 1.1 + 0.2}),
                     ("offload", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2}),
                     ("offload-fp8", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2,
                                      "kv_cache_dtype": "fp8"})):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="infinitehip", max_model_len=length + 256, max_num_seqs=2,
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
    f8 = res["offload-fp8"]
    f8_same = sum(x == y for x, y in zip(a["tokens"], f8["tokens"]))
    return (f"fp8 offloaded: {f8_same}/{len(a['tokens'])} greedy tokens as bf16, {f8['tok_s']:.1f} tok/s; "
            f"{length} tokens, pool 1/8 of the KV: tokens {same}/{len(a['tokens'])} and logits equal; prefill "
            f"{a['prefill_s']:.2f} s -> {b['prefill_s']:.2f} s, decode {a['tok_s']:.1f} -> {b['tok_s']:.1f} tok/s, "
            f"hit ratio {hit:.3f}, installed {b['stats']['pages_installed']} pages")
