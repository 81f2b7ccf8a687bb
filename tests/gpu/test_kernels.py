"""The kernels against their PyTorch references in bf16 at real sizes: paged decode, block-sparse attention, chunk
scoring, MInference's range/column kernel and the fused decode-step kernels (the interpreter tests in tests/ run the
same comparisons at small sizes in fp32/fp16)."""
from __future__ import annotations

import torch

from longreach.kernels.paged_decode import paged_decode, paged_decode_reference
from longreach.rope.strategies import RopeArgs

from .common import llama_inv_freq, random_paged_kv, rel_err


def test_paged_decode(detail):
    """Paged decode vs its reference on 90 cases: five head shapes (GQA 1-8, D 64/128), batch 1 at 32K to batch 32,
    pages of 16 and 64, 1 / 7 / 32 splits; bf16, poisoned workspaces. The kernel may be at most ~2x as far from an
    fp64 reference as PyTorch's own bf16 computation."""
    dev = "cuda"
    cases = []
    for (Hq, Hkv, D) in [(9, 3, 64), (32, 8, 128), (8, 8, 64), (32, 4, 128), (12, 4, 64)]:
        for B, max_len in [(1, 32768 + 17), (4, 4099), (32, 1000)]:
            for page in (16, 64):
                cases.append((B, Hq, Hkv, D, page, max_len))
    worst = 0.0
    for (B, Hq, Hkv, D, page, max_len) in cases:
        g = torch.Generator(device=dev).manual_seed(B * 7 + D + page)
        lens = torch.randint(1, max_len + 1, (B,), device=dev, generator=g)
        lens[0] = max_len
        pps = -(-max_len // page)
        n_pages = B * pps + 5
        tables = torch.randperm(n_pages, device=dev, generator=g)[: B * pps].view(B, pps).int()
        k = torch.randn(n_pages, page, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(n_pages, page, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(B, Hq, D, device=dev, generator=g, dtype=torch.bfloat16)
        for splits in (1, 7, 32):
            ws = (torch.full((B, Hq, splits, D), float("nan"), device=dev),
                  torch.full((B, Hq, splits), float("nan"), device=dev))
            out, lse = paged_decode(q, k, v, tables, lens.int(), D ** -0.5, num_splits=splits, workspace=ws)
            # fp64 reference vs bf16 PyTorch reference: the kernel may be at most ~2x as far from fp64 as torch's bf16
            ref64, _ = paged_decode_reference(q.double(), k.double(), v.double(), tables, lens.int(), D ** -0.5)
            ref16, _ = paged_decode_reference(q, k, v, tables, lens.int(), D ** -0.5)
            err = ((out.double() - ref64).norm() / ref64.norm()).item()
            base = ((ref16.double() - ref64).norm() / ref64.norm()).item()
            if torch.isnan(out).any() or err > 2 * base + 1e-3:
                raise AssertionError(f"B={B} H={Hq}/{Hkv} D={D} page={page} len={max_len} splits={splits}: "
                                     f"rel err {err:.2e} vs torch bf16 {base:.2e}")
            worst = max(worst, err)
    detail(f"{len(cases) * 3} cases, worst relative error {worst:.2e} (bf16)")


def test_block_sparse_attention(detail):
    """Block-sparse attention kernel vs the PyTorch executor (fp32 math on the same bf16 inputs), real sizes."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton

    dev = "cuda"
    worst = 0.0
    n = 0
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64), (8, 8, 128), (32, 4, 128)]:
        for groups in sorted({1, Hkv, Hq}):
            for decode in (False, True):
                g = torch.Generator(device=dev).manual_seed(Hq + D + groups + decode)
                lens_ctx = [20000, 9000] if decode else [16384 + 37, 0]
                lens_q = [1, 1] if decode else [131, 300]
                L = [c + q for c, q in zip(lens_ctx, lens_q)]
                kc, vc, tables = random_paged_kv(dev, g, L, 16, Hkv, D)
                q = torch.randn(sum(lens_q), Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
                BQ, BK = (1 if decode else 64), 8
                qb = QueryBlocks.build(lens_q, lens_ctx, BQ)
                sels = []
                for b in range(qb.num_blocks):
                    nblk = -(-L[qb.seq[b]] // BK)
                    sels.append(torch.stack([torch.randperm(nblk, device=dev, generator=g)[: min(256, nblk)]
                                             for _ in range(groups)]))
                blocks, counts = SparseIndex.pack(sels, dev)
                idx = SparseIndex(BQ, BK, 256, 1024, groups, qb, blocks, counts)
                for mode in (("none", "st", "il", "de") if groups == Hkv else ("none",)):
                    rope = None if mode == "none" else RopeArgs(mode, llama_inv_freq(D), rope_from=0, group=4)
                    ref, _ = block_sparse_attention(q, kc, vc, tables, idx, D ** -0.5, rope=rope)
                    for splits in ((1, 8, 32) if decode else (1, 4, 9)):  # prefill: kernels/bsa.py prefill_splits
                        out = torch.full_like(q, float("nan"))
                        block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits, out=out,
                                                      rope=rope)
                        err = rel_err(out, ref)
                        n += 1
                        if torch.isnan(out).any() or err > 1e-2:
                            raise AssertionError(f"H={Hq}/{Hkv} D={D} groups={groups} decode={decode} "
                                                 f"splits={splits} rope={mode}: rel err {err:.2e}")
                        worst = max(worst, err)
    detail(f"{n} cases (prefill + decode, split-K in both, groups 1/H_kv/H_q, RoPE none/st/il/de), worst relative error "
           f"{worst:.2e} "
           "vs fp32 reference")


def test_chunk_scores(detail):
    """Chunk-scoring kernel vs its reference, real sizes, bf16: scores and the top-k sets they induce."""
    from longreach.kernels.prune_ref import chunk_scores_reference
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.kvcache.paged import gather_tokens

    dev = "cuda"
    worst_val, worst_set, n = 0.0, 1.0, 0
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64), (14, 2, 64)]:  # the 8B shape, SmolLM2's, Qwen2.5 0.5B's
        # the last cases: exact 32-key chunks scored per run of 8 keys (infinitehip's stage 2 read from stage 1's
        # runs), and from every 2nd / 4th row of the blocks (infinitehip's query_stride)
        for i, (chunk, exact, rows, L, sub, stride) in enumerate([
                (256, False, 64, 65536, None, 1), (32, False, 64, 20000, None, 1), (8, True, 64, 20000, None, 1),
                (256, False, 1, 131072, None, 1), (8, True, 1, 20000, None, 1), (2, True, 32, 20000, None, 1),
                (32, True, 64, 20000, 8, 1), (32, True, 64, 20000, None, 2), (8, True, 64, 20000, None, 4)]):
            g = torch.Generator(device=dev).manual_seed(chunk + rows + Hq)
            page = 16
            kc = torch.randn(-(-L // page), page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            table = torch.arange(kc.shape[0], device=dev, dtype=torch.int32)
            nb = 4
            q = torch.randn(nb * rows, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            starts = torch.arange(nb, device=dev) * rows
            lens = torch.full((nb,), rows, device=dev)
            cand_end = torch.full((nb,), L - 1024, device=dev)
            C = min(1024, (L - 1024) // chunk)
            ids = torch.stack([torch.randperm((L - 1024) // chunk, device=dev, generator=g)[:C]
                               for _ in range(nb * Hkv)]).view(nb, Hkv, C)
            # SmolLM2's and Qwen's shapes with the pruning strategies
            mode = ("rt", "ci", "de")[i % 3] if Hq in (9, 14) else "none"
            if mode == "ci":
                ids = ids.sort(-1).values  # ci numbers candidates in position order, as the stages produce them
            rope = None if mode == "none" else RopeArgs(mode, llama_inv_freq(D), rope_from=0, group=4, n_window=1024)
            keys = gather_tokens(kc, table, L)
            r = torch.arange((rows - 1) % stride, rows, stride, device=dev)  # the block's last row and every stride-th
            qs = q[(starts[:, None] + r)].reshape(nb, r.numel(), Hq, D)
            ref = chunk_scores_reference(qs, torch.ones(nb, r.numel(), dtype=torch.bool, device=dev), keys, ids.long(),
                                         chunk, exact, 256, cand_end, Hkv, rope=rope, sub=sub, stride=stride)
            fin = torch.isfinite(ref)
            # exact multi-row blocks: the first layout and the long-prefill one (row tiles of 128 to 512 rows)
            for rows_tile in ((None, 128, 256, 512) if exact and rows > 1 else (None,)):
                got = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, 256, Hkv,
                                          rope=rope, rows_tile=rows_tile, sub=sub, stride=stride)
                worst_val, worst_set = _check_scores(got, ref, fin, C * chunk // (sub or chunk),
                                                     (Hq, Hkv, chunk, exact, rows, mode, rows_tile, sub, stride),
                                                     worst_val, worst_set)
                n += 1
    detail(f"{n} cases (SmolLM2's and Qwen 0.5B's shapes with rt/ci/de; exact scoring in both layouts, also per run "
           f"of 8 keys and from every 2nd / 4th query row), at most "
           f"{worst_val:.2%} of scores off by >5% (SelectRep ties), top-k overlap >= {worst_set:.3f}")


def _check_scores(got, ref, fin, C, case, worst_val, worst_set):
    """test_chunk_scores' criteria for one case: the same invalid chunks, at most 2% of scores off by > 5%, top-k
    overlap >= 0.97; returns the running worst of both."""
    if not torch.equal(torch.isfinite(got), fin):
        raise AssertionError(f"(Hq, Hkv, chunk, exact, rows, rope, rows_tile, sub) = {case}: different invalid chunks")
    rel = ((got[fin] - ref[fin]).abs() / ref[fin].abs().clamp(min=1.0))
    frac_off = (rel > 0.05).float().mean().item()  # SelectRep branches decided by bf16 near-ties
    k = max(1, C // 8)
    top_got = got.topk(k, dim=-1).indices.sort(-1).values
    top_ref = ref.topk(k, dim=-1).indices.sort(-1).values
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in
                  zip(top_got.flatten(0, 1), top_ref.flatten(0, 1))) / top_ref.numel()
    if frac_off > 0.02 or overlap < 0.97:
        raise AssertionError(f"(Hq, Hkv, chunk, exact, rows, rope, rows_tile, sub) = {case}: {frac_off:.1%} scores off "
                             f"by >5%, top-k overlap {overlap:.3f}")
    return max(worst_val, frac_off), min(worst_set, overlap)


def test_minference_range_kernel(detail):
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
            kc, vc, tables = random_paged_kv(dev, g, L, 16, Hkv, D)
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
            err = rel_err(out, ref)
            n += 1
            costs.append(index_cost(idx))
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} granularity={gran}: rel err {err:.2e}")
            worst = max(worst, err)
    detail(f"{n} cases (per head / per KV group, Λ + vertical-slash + block-sparse in one layer), worst relative "
           f"error {worst:.2e} vs fp32 reference; kernel keys/row {min(costs):.0f}-{max(costs):.0f}")


def test_fused_kernels(detail):
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
    detail(f"residual sums bit-exact; RoPE / RMSNorm / SiLU*up differ from PyTorch (by one bf16 unit at most) on "
           f"{100 * worst['rope']:.3f}% / {100 * worst['rms_norm']:.2f}% / {100 * worst['silu_mul']:.2f}% of "
           "elements; KV write bf16 and fp8, "
           "one and two tiers, byte-equal to the PyTorch path; note_reads marks the same pages")


def test_topk_kernel(detail):
    """The selection's top-k (ascending ids, counts) vs its reference at the decode and prefill stages' real sizes:
    stage 0 of 3k-box at 1M (16,384 candidate chunks, keep 512: the multi-tile path), stages 1-2 (1,024 / 2,048
    candidates), rows of 8 KV heads and 64 query blocks; bf16 scores (as the scorers round them), some -inf, ties;
    and the in-place output the captured decode step uses (the first k columns of a wider index)."""
    from longreach.kernels.topk import topk_ascending_reference, topk_ascending_triton

    dev = "cuda"
    cases = 0
    for rows, C, k in [(8, 16384, 512), (512, 16384, 512), (8, 1024, 256), (8, 2048, 256), (512, 1024, 256),
                       (8, 100, 256)]:
        g = torch.Generator(device=dev).manual_seed(rows + C + k)
        scores = torch.randn(rows, C, device=dev, generator=g).bfloat16().float()  # bf16-rounded: ties
        scores[:, ::11] = float("-inf")
        ids = torch.arange(C, device=dev, dtype=torch.int32).expand(rows, C).contiguous()
        want = topk_ascending_reference(ids, scores, k)
        got = topk_ascending_triton(ids, scores, k)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise AssertionError(f"top-k differs from its reference at rows {rows}, C {C}, k {k}")
        index = torch.full((rows, k + 9), -1, dtype=torch.int32, device=dev)
        counts = torch.zeros(rows, dtype=torch.int32, device=dev)
        topk_ascending_triton(ids, scores, k, out=(index[:, :k], counts))
        if not (torch.equal(index[:, :k], want[0]) and torch.equal(counts, want[1]) and (index[:, k:] == -1).all()):
            raise AssertionError(f"top-k written in place differs at rows {rows}, C {C}, k {k}")
        cases += 1
    detail(f"{cases} cases equal to the reference (ids and counts; in place into a wider index too)")
