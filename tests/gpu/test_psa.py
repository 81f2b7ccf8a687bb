"""PSA (attention/psa/) on the GPU: the decode, metadata and scoring kernels against their references (bf16, 8B
shape, 128K), the parts of a decode step timed in CUDA graphs, and the `rope: rank` positions."""
from __future__ import annotations

import torch

from .common import llama_inv_freq, median_us, rel_err, two_tier


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


def test_psa_kernels(detail):
    """PSA at Llama-8B's shape and 128K (attention/psa/): the metadata, scoring and both decode kernels (loop and
    waves, kernels/psa_decode.py) against their PyTorch references (fp32 math on the same bf16 inputs), one tier,
    two tiers (pinned host pages over UVA) and fp8 rows; the decode step captured in a CUDA graph == eager, with
    either kernel; and the time of one decode step (rank + loop) next to the dense paged-decode kernel, with the keys
    it read, and of the two decode kernels alone (CUDA graphs, batch 1)."""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.key_boxes import (build_page_boxes_reference, build_page_boxes_triton,
                                             page_box_scores_reference, page_box_scores_triton)
    from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves
    from longreach.kernels.paged_decode import paged_decode
    from longreach.kvcache.fp8 import encode

    dev, lengths, pages, dtype = "cuda", (131072 + 5, 40000, 777), (16, 32), torch.bfloat16
    Hq, Hkv, D = 32, 8, 128
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
        build_page_boxes_triton(kc, tables, lo, hi, int(hi.max()), meta, "cuboid-mean")
        ref_meta = torch.zeros(P, 2, Hkv, D, dtype=torch.float32, device=dev)
        build_page_boxes_reference(kc, tables, lo, hi, ref_meta, "cuboid-mean")
        err = rel_err(meta.float(), ref_meta)
        if err > 1e-2:
            raise AssertionError(f"page {page}: block metadata rel err {err:.2e}")
        methods = {name: PSA(PSAConfig(n_sink=64, n_window=128, decode_kernel=name), Hq, Hkv) for name in kernels}
        m = methods["loop"]
        cand_lo, cand_hi = m.candidates(seq_lens, page)
        W = tables.shape[1]
        scores = page_box_scores_triton(q, meta, tables, cand_lo, cand_hi, W)
        ref_scores = page_box_scores_reference(q, meta, tables, cand_lo, cand_hi, W)
        fin = torch.isfinite(ref_scores)
        if not torch.equal(fin, torch.isfinite(scores)) or rel_err(scores[fin], ref_scores[fin]) > 1e-3:
            raise AssertionError(f"page {page}: block scores differ from the reference")
        ranked = scores.sort(dim=-1, descending=True, stable=True).indices.int()
        scale = D ** -0.5
        caches = {"one tier": (kc, vc), "two tiers": tuple(two_tier(kc, vc, 0.3, g))}
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
                err = rel_err(out, reference_on(counts))
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
                if rel_err(o8, reference_on(c8, True)) > 1e-2:
                    raise AssertionError(f"{name} kernel, page {page} eps {eps}: fp8 rel err "
                                         f"{rel_err(o8, reference_on(c8, True)):.2e}")
            pairs += ref_counts.numel()
            disagree += int((reads["loop"] != reads["waves"]).sum())
            if eps == 0.95:
                keys = (reads["loop"].float() * page).mean().item()
                notes.append(f"page {page}: eps 0.95 reads {keys:.0f} ranked keys per (row, KV head) of "
                             f"{(cand_hi.float() - cand_lo).mean().item() * page:.0f}")
        # the decode step (scores, sort, loop or waves) in a CUDA graph, replayed on new queries
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
        one = slice(0, 1)  # the time of one decode step, batch 1 at 128K
        step = (q[one], kc, vc, tables[one], seq_lens[one], meta, W, scale, True)
        t_psa = median_us(lambda: m.attend(*step))
        t_dense = median_us(lambda: paged_decode(q[one], kc, vc, tables[one], seq_lens[one], scale, num_splits=32))
        notes.append(f"page {page}, batch 1 at {lengths[0]}: psa decode step {t_psa:.0f} us (scores + sort "
                     f"+ loop), dense paged decode {t_dense:.0f} us")
        dec = (q[one], kc, vc, tables[one], seq_lens[one], ranked[one], cand_lo, cand_hi[one], 0.95, 4, scale)
        t = {name: median_us(captured(lambda run=run: run(*dec))[0].replay) for name, run in kernels.items()}
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
    detail(f"kernels == references (worst output rel err loop {worst['loop']:.2e} / waves {worst['waves']:.2e}, "
           f"reads equal in {pairs - mismatched['loop']} / {pairs - mismatched['waves']} of {pairs} pairs; "
           f"waves == loop reads in {pairs - disagree}/{pairs}); fp8; tiered == one tier; graph replay == eager. "
           + "; ".join(notes))


def test_psa_step_times(detail):
    """Where a PSA decode step's time goes, every part captured in a CUDA graph and timed by its replays (batch 1,
    8B shape, random keys with a few hot blocks, eps 0.95): block scores, the stable sort, the loop and waves
    kernels alone, the whole step (`PSA.attend`) with either kernel, and dense paged decode over the same cache.
    The width is the engine's: the graph bucket (a power of two >= the length) in pages. test_psa_kernels checks
    the results; this only times them."""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.key_boxes import build_page_boxes_triton, page_box_scores_triton
    from longreach.kernels.paged_decode import default_num_splits, paged_decode
    from longreach.kernels.psa_decode import psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves

    dev, lengths, page, dtype = "cuda", (131072 + 5, 1048576 + 5), 16, torch.bfloat16
    Hq, Hkv, D = 32, 8, 128
    rows = []

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_us(graph.replay)

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
        build_page_boxes_triton(kc, tables, zero, ((seq_lens - 1) // page).int(), need, meta, "cuboid-mean")
        scale = D ** -0.5
        methods = {k: PSA(PSAConfig(decode_kernel=k), Hq, Hkv) for k in ("loop", "waves")}
        m = methods["loop"]
        cand_lo, cand_hi = m.candidates(seq_lens, page)
        splits = default_num_splits(1, Hkv, length)
        t_dense = timed(lambda: paged_decode(q, kc, vc, tables, seq_lens, scale, num_splits=splits))
        # "hot": a shared direction and hot blocks; "flat": q scaled down, attention near uniform (as with random
        # weights), so the stop rule reads ~eps of the candidates
        for case, qq in (("hot", q), ("flat", q * 0.01)):
            scores = page_box_scores_triton(qq, meta, tables, cand_lo, cand_hi, width)
            ranked = scores.sort(dim=-1, descending=True, stable=True).indices.int()
            t = {"scores": timed(lambda: page_box_scores_triton(qq, meta, tables, cand_lo, cand_hi, width)),
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
    detail("; ".join(rows))


def test_psa_rank_rope(detail):
    """PSA's `rope: rank` positions in bf16 at the 8B shape: the moved-key metadata kernel and both decode kernels
    against their PyTorch references (fp32 math on the same bf16 inputs); rows past and before rope_from."""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.key_boxes import (build_page_boxes_reference, build_page_boxes_triton,
                                             page_box_scores_triton)
    from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
    from longreach.kernels.psa_waves import psa_decode_waves

    dev, page, rope_from, dtype = "cuda", 16, 8192, torch.bfloat16
    lengths = (131072 + 5, 100003, 65536, 40000, 9000, 777)
    Hq, Hkv, D = 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(11)
    tables, seq_lens, kc, vc = _random_paged(dev, g, lengths, page, Hkv, D, dtype)
    P = kc.shape[0]
    q = torch.randn(len(lengths), Hq, D, device=dev, generator=g, dtype=dtype)
    inv = llama_inv_freq(D).float()
    lo = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
    hi = ((seq_lens - 1) // page).int()
    meta = torch.zeros(P, 2, Hkv, D, dtype=dtype, device=dev)
    build_page_boxes_triton(kc, tables, lo, hi, int(hi.max()), meta, "cuboid-mean", inv)
    ref_meta = torch.zeros(P, 2, Hkv, D, dtype=torch.float32, device=dev)
    build_page_boxes_reference(kc, tables, lo, hi, ref_meta, "cuboid-mean", inv)
    built = torch.cat([tables[i, :int(hi[i])] for i in range(len(lengths))]).long()
    err_meta = rel_err(meta[built].float(), ref_meta[built])
    if err_meta > 1e-2:
        raise AssertionError(f"moved metadata rel err {err_meta:.2e}")
    m = PSA(PSAConfig(), Hq, Hkv)
    cand_lo, cand_hi = m.candidates(seq_lens, page)
    ranked = page_box_scores_triton(q, meta, tables, cand_lo, cand_hi, tables.shape[1]).sort(
        dim=-1, descending=True, stable=True).indices.int()
    rope, notes, scale = (inv, rope_from), [], D ** -0.5
    for eps in (0.9, 0.95):
        args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
        _, _, ref_counts = psa_decode_reference(*args, rope=rope)
        for name, run in (("loop", psa_decode_triton), ("waves", psa_decode_waves)):
            out, _, counts = run(*args, rope=rope)
            forced = psa_decode_reference(*args, counts=counts, rope=rope)[0]
            err = rel_err(out, forced)
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"{name}, eps {eps}: rel err {err:.2e} against the reference on its reads")
            # The stop test compares a running estimate with epsilon: a row near it stops one micro-batch earlier
            # or later under another fp32 summation order (bf16 keys rotated in the kernel, in torch for the
            # reference). Most rows must agree exactly, and none may be more than one micro-batch (4 blocks) off.
            agree = int((counts == ref_counts).sum())
            off = int((counts.long() - ref_counts.long()).abs().max())
            if agree < 0.9 * counts.numel() or off > 4:
                raise AssertionError(f"{name}, eps {eps}: reads equal the reference in {agree}/{counts.numel()}, "
                                     f"at most {off} blocks apart; blocks read {counts.tolist()} vs reference "
                                     f"{ref_counts.tolist()}")
            notes.append(f"{name} eps {eps}: rel err {err:.1e}, reads equal {agree}/{counts.numel()} (at most "
                         f"{off} blocks apart)")
    detail(f"moved metadata rel err {err_meta:.1e}; " + "; ".join(notes))
