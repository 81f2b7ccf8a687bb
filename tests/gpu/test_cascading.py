"""The Cascading KV cache (attention/cascading/) on the GPU: its kernels (cache-RoPE attention, key mass, insertion
and moves, the gathered prefill) against their references at the `16k` preset's real sizes with their times, and
through the engine on a real model: GPU kernels == the CPU reference, passkey against streaming with the same memory,
and prefill time against dense."""
from __future__ import annotations

import gc
import time

import torch

from longreach.rope.strategies import RopeArgs

from .common import essay_text, llama_inv_freq, median_us, rel_err

CASCADE_SMALL = '{"n_sink": 64, "num_subcaches": 4, "subcache_size": 256, "stride": 512}'  # 1,088 tokens: drops


def test_cascading_kernels(detail):
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
            rope = RopeArgs("cache", llama_inv_freq(D), 0)
            ref, lse_ref = block_sparse_attention(q, kc, vc, table, idx, D ** -0.5, rope=rope)
            out = torch.full_like(q, float("nan"))
            splits = 1 if rows > 1 else 16
            block_sparse_attention_triton(q, kc, vc, table, idx, D ** -0.5, num_splits=splits, rope=rope, out=out)
            worst_o = max(worst_o, rel_err(out, ref))
            args = (q, kc, table, torch.arange(B, device=dev) * rows, torch.full((B,), rows, device=dev),
                    torch.full((B,), cached, device=dev), torch.full((B,), V, device=dev), lse_ref,
                    torch.rand(B * rows, device=dev, generator=g), D ** -0.5, rope)
            mref = key_mass_reference(*args)
            mgot = key_mass_triton(*args)
            worst_m = max(worst_m, rel_err(mgot, mref))
            n += 1
            if torch.isnan(out).any() or worst_o > 2e-2 or worst_m > 2e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} rows={rows} keys={V}: attention rel err {worst_o:.2e}, "
                                     f"key mass rel err {worst_m:.2e}")
    detail(f"{n} cases (prefill 1024 rows x 17K keys, decode x4 over 65K), worst rel err attention {worst_o:.2e}, "
           f"key mass {worst_m:.2e} (bf16 vs fp32 reference)")


def test_cascading_insert(detail):
    """Cascading insertion and RoPE kernels (kernels/cascade_insert.py) vs their PyTorch references at the `16k`
    preset's real sizes (64 sink + 8 x 2040, rings full), a 4,096-token prefill stride and a decode step, SmolLM2's
    and Llama-8B's KV heads: the EMA within fp32 rounding, every source exactly as `execute_plan` resolves it on the
    kernel's importance, the moves exactly as `apply_moves`, the RoPE kernel within bf16 rounding; and the time of
    one (layer, stride) either way (CUDA events around the host calls, so launch overhead counts)."""
    import numpy as np

    from longreach.attention.cascading.attend import unrotation
    from longreach.kernels.cascade_insert import (cascade_insert_reference, cascade_insert_triton,
                                                  cascade_rope_reference, cascade_rope_triton, move_rows_triton)
    from longreach.rope.strategies import rotation
    from longreach.attention.cascading.rings import CascadeRings, apply_moves, batch_plans, execute_plan

    dev, S, sizes = "cuda", 64, [2040] * 8
    lines = []
    for H, D in ((3, 64), (8, 128)):
        for n in (4096, 1):
            rings = CascadeRings(S, sizes)
            stage0 = S + sum(sizes)
            for _ in range(40):  # fill every ring and cascade past it
                rings.plan(4096, stage0 + np.arange(4096 - max(0, min(S, rings.tokens + 4096) - rings.tokens)))
            cached = rings.chronological()
            plan = batch_plans([rings.plan(n, stage0 + np.arange(n))], [lambda a: a], dev)
            nslots = stage0 + 4096
            g = torch.Generator(device=dev).manual_seed(H * 7 + n)
            slots = torch.from_numpy(np.concatenate([cached, stage0 + np.arange(n)])).to(dev)
            key = torch.randperm(nslots, device=dev, generator=g)[: len(slots)]
            decay = torch.where(slots < stage0, 0.999 ** n, 0.0).float()
            mass = torch.rand(1, H, nslots, device=dev, generator=g)
            score = torch.rand(nslots, H, device=dev, generator=g)
            kv = [torch.randn(nslots, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2)]
            pos = torch.randint(0, 1 << 20, (nslots, H), device=dev, dtype=torch.int32, generator=g)
            s_ref, s_got = score.clone(), score.clone()
            cascade_insert_reference(plan, s_ref, mass, slots, key, decay)
            src = cascade_insert_triton(plan, s_got, mass, slots, key, decay)
            torch.cuda.synchronize()
            if rel_err(s_got, s_ref) > 1e-6:
                raise AssertionError(f"H={H} n={n}: EMA rel err {rel_err(s_got, s_ref):.2e}")
            want_src = execute_plan(plan, s_got)[1]  # the rules on the kernel's own importances
            if not torch.equal(src, want_src):
                raise AssertionError(f"H={H} n={n}: {(src != want_src).sum().item()} of {src.numel()} sources differ")
            want = [t.clone() for t in (*kv, s_got, pos)]
            apply_moves(plan.dst, src, want)
            got = [t.clone() for t in (*kv, s_got, pos)]
            move_rows_triton(plan.dst, src, *got)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise AssertionError(f"H={H} n={n}: moved rows differ from apply_moves")
            t_torch = median_us(lambda: apply_moves(
                plan.dst, cascade_insert_reference(plan, score, mass, slots, key, decay), (*kv, score, pos)))
            t_kern = median_us(lambda: move_rows_triton(
                plan.dst, cascade_insert_triton(plan, score, mass, slots, key, decay), *kv, score, pos))
            lines.append(f"H{H} d{D} n={n}: {plan.dst.shape[0]} moves, torch {t_torch:.0f} us, kernels {t_kern:.0f} us")
            # the step's RoPE kernel: n rows (strided q/k views as the model hands them), H query heads per 3
            qkv = torch.randn(n, 3 * H + 2 * H, D, device=dev, dtype=torch.bfloat16, generator=g)
            q, k = qkv[:, :3 * H], qkv[:, 3 * H:4 * H]
            tpos = torch.arange(n, device=dev) + (1 << 20) - n
            virt = torch.arange(n, device=dev)[:, None] + 16000
            tables = unrotation(tpos, llama_inv_freq(D)), rotation(virt, llama_inv_freq(D))
            rows = torch.randperm(nslots, device=dev, generator=g)[:n]
            want, got = (kv[0].clone(), pos.clone()), (kv[0].clone(), pos.clone())
            q_ref = cascade_rope_reference(q, k, *want, rows, tpos[:, None].int(), *tables)
            q_got = cascade_rope_triton(q, k, *got, rows, tpos[:, None].int(), *tables)
            err = max(rel_err(q_got, q_ref), rel_err(got[0], want[0]))
            if err > 1e-2 or not torch.equal(got[1], want[1]):
                raise AssertionError(f"H={H} n={n}: rope kernel rel err {err:.2e} or positions differ")
            t_rr = median_us(lambda: cascade_rope_reference(q, k, *want, rows, tpos[:, None].int(), *tables))
            t_rk = median_us(lambda: cascade_rope_triton(q, k, *got, rows, tpos[:, None].int(), *tables))
            lines.append(f"rope rel err {err:.1e}, torch {t_rr:.0f} us, kernel {t_rk:.0f} us")
    detail("; ".join(lines))


def test_cascading_flash(detail):
    """Cascading's gathered prefill path (gather_virtual + FlashAttention, attention/cascading/attend.py) vs its block-sparse
    path (the Triton kernel, keys rotated per query block) on the same stride, at the `16k` preset's real sizes
    (64 sink + 8 x 2040 rings full, a 4,096-row stride: 20,480 keys), SmolLM2's and Llama-8B's heads, bf16: output,
    log-sum-exp and key mass; both against the fp32 reference on the gathered keys; the time of one (layer, stride)
    either way, attention and key mass (CUDA events around the host calls, so launch overhead counts)."""
    import json

    import numpy as np

    from longreach.attention.cascading import CascadingBackend
    from longreach.attention.cascading.attend import causal_attention_lse, gather_virtual
    from longreach.attention.cascading.plan import _batch as batch_strides
    from longreach.config import EngineConfig
    from longreach.attention.cascading.rings import CascadeRings
    from longreach.models.config import ModelConfig, RopeConfig
    from longreach.rope.strategies import rotation

    dev, S, n = torch.device("cuda"), 64, 4096
    lines = []
    for Hq, Hkv, D in ((9, 3, 64), (32, 8, 128)):
        mc = ModelConfig("llama", 32, 32, 64, 1, Hq, Hkv, D, 1e-5, 8192, rope=RopeConfig(theta=500000.0))
        ec = EngineConfig(model="x", attention="cascading", attention_config=json.dumps({"stride": n}), preset="16k",
                          max_num_batched_tokens=65536)
        be = CascadingBackend(mc, ec, dev)
        rings = CascadeRings(S, be.sizes)
        stage0 = S + sum(be.sizes)
        for _ in range(40):  # fill every ring and cascade past it
            rings.plan(n, stage0 + np.arange(n - max(0, min(S, rings.tokens + n) - rings.tokens)))
        cached = rings.chronological()
        virt = np.concatenate([np.arange(S), cached, stage0 + np.arange(n)])
        item = dict(row=0, n=n, V=len(virt), sink=S, cached=len(cached), slots=virt,
                    plan=rings.plan(n, stage0 + np.arange(n)), to_flat=lambda a: a)
        sub = batch_strides([item], True, be.config, dev)
        V = len(virt)
        be._virt_cs = rotation(torch.arange(V, device=dev), be.inv_freq)
        g = torch.Generator(device=dev).manual_seed(Hq)
        nslots = stage0 + n
        # keys with a shared direction, so that attention is peaked (not uniform) and the mass test means something
        kf = torch.randn(nslots, Hkv, D, device=dev, generator=g) + 2 * torch.randn(1, Hkv, D, device=dev, generator=g)
        kf, vf = kf.bfloat16(), torch.randn(nslots, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        q = torch.randn(n, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        kv1 = kf.view(-1, 1, Hkv, D), vf.view(-1, 1, Hkv, D)
        o_b, l_b = be._attend(q, *kv1, sub)
        m_b = be._key_mass(q, kv1[0], sub.table, l_b, sub, be.rope)
        o_f, m_f = be._gathered_step(q, kf, vf, sub, "flash")
        kg, vg = gather_virtual(kf, vf, sub.table[0], *be._virt_cs)
        o_r, l_r = causal_attention_lse(q.float(), kg.float(), vg.float(), be.scale, "reference")
        l_f = causal_attention_lse(q, kg, vg, be.scale, "flash")[1]
        errs = dict(out=rel_err(o_f, o_r), out_bsa=rel_err(o_b, o_r), lse=(l_f - l_r).abs().max().item(),
                    lse_bsa=(l_b - l_r).abs().max().item(), mass=rel_err(m_f, m_b))
        if errs["out"] > 2e-2 or errs["lse"] > 2e-2 or errs["mass"] > 2e-2 or errs["out_bsa"] > 2e-2:
            raise AssertionError(f"H{Hq}/{Hkv} d{D}: {errs}")
        t_b = median_us(lambda: be._attend(q, *kv1, sub), reps=20)
        t_f = median_us(lambda: causal_attention_lse(q, *gather_virtual(kf, vf, sub.table[0], *be._virt_cs),
                                                     be.scale, "flash"), reps=20)
        t_mb = median_us(lambda: be._key_mass(q, kv1[0], sub.table, l_b, sub, be.rope), reps=20)
        t_step = median_us(lambda: be._gathered_step(q, kf, vf, sub, "flash"), reps=20)
        lines.append(f"H{Hq}/{Hkv} d{D} {n}x{V}: rel err out {errs['out']:.1e} (bsa {errs['out_bsa']:.1e}), lse "
                     f"{errs['lse']:.1e}, mass vs bsa path {errs['mass']:.1e}; attention bsa {t_b:.0f} us, "
                     f"gather+flash {t_f:.0f} us ({t_b / t_f:.2f}x); with the key mass: block-sparse path "
                     f"{t_b + t_mb:.0f} us, gathered step {t_step:.0f} us ({(t_b + t_mb) / t_step:.2f}x)")
    detail("; ".join(lines))


def test_cascading_engine(gpu_model, detail):
    """Cascading through the engine on the GPU (Triton kernels) vs the CPU reference path: a 3K-token prompt with a
    1,088-token cache (hundreds of drops), 24 greedy tokens."""
    from longreach import LLM, SamplingParams

    text = essay_text()
    outs = []
    for device in ("cuda", "cpu"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_model, attention="cascading", attention_config=CASCADE_SMALL, device=device, dtype="float32",
                  max_model_len=4096, max_num_seqs=1, kv_cache_memory_gb=1)
        ids = llm.get_tokenizer().encode(text)[:3000]
        outs.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True), use_tqdm=False)[0])
        llm.engine.backend.check_integrity()
        del llm
    same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
    if same < 20:
        raise AssertionError(f"cascading: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    # bf16 (fp32 has no FlashAttention): the gathered prefill path against the block-sparse one
    bf = []
    for flash in (True, False):
        gc.collect()
        torch.cuda.empty_cache()
        conf = CASCADE_SMALL[:-1] + f', "flash_prefill": {str(flash).lower()}}}'
        llm = LLM(gpu_model, attention="cascading", attention_config=conf, device="cuda", max_model_len=4096,
                  max_num_seqs=1, kv_cache_memory_gb=1)
        bf.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True), use_tqdm=False)[0])
        del llm
    lead = next((i for i, (a, b) in enumerate(zip(bf[0].token_ids, bf[1].token_ids)) if a != b), 24)
    if lead < 4:
        raise AssertionError(f"cascading bf16: flash and block-sparse prefill differ from greedy token {lead}")
    detail(f"GPU kernels vs CPU reference, fp32, {same}/24 greedy tokens equal; bf16 flash vs block-sparse prefill: "
           f"the first {lead}/24 greedy tokens equal")


def test_cascading_passkey(gpu_model, detail):
    """Passkey: cascading `4k` (64 sink + 4 x 1008) vs streaming with the same memory (64 sink + 4032 window) at
    growing lengths, every depth (the blog's experiment at SmolLM2's scale; the blog: 65K cache to 1M on a larger
    model). Reports accuracy per length and depth and prefill seconds; quality is measured, not asserted."""
    from longreach import LLM, SamplingParams
    from longreach.tools.eval.passkey import passkey_prompt, score

    lengths, depths, seeds = (8192, 16384, 32768, 65536), (0.05, 0.25, 0.5, 0.75, 0.95), 2
    rows = {}
    for name, conf in (("cascading:4k", ("cascading", None)),
                       ("streaming:4096", ("streaming", '{"n_sink": 64, "n_window": 4032}'))):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_model, attention=conf[0], preset="4k" if conf[0] == "cascading" else None,
                  attention_config=conf[1], max_model_len=max(lengths) + 16, max_num_seqs=4,
                  kv_cache_memory_gb=8 if conf[0] == "streaming" else 2, max_num_batched_tokens=8192)
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
    detail(f"depths {list(depths)}, {seeds} keys per cell: " + "; ".join(lines))


def test_cascading_prefill(gpu_model, detail):
    """Prefill time of cascading `16k` (64 sink + 8 x 2040, stride 4096) through the engine vs dense (cuDNN) at the
    lengths where its KV fits, SmolLM2; the blog: 15% of FlashAttention's time at 1M with a 16K cache (A6000)."""
    from longreach import LLM, SamplingParams

    lengths = (131072, 1048576)
    res = []
    for name in ("cascading", "dense"):
        for n in lengths:
            if name == "dense" and n > 262144:
                continue  # 1M dense: ~23 GB of KV and minutes; extrapolated from 128K below
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(gpu_model, attention=name, preset="16k" if name == "cascading" else None, max_model_len=n + 16,
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
    detail(", ".join(f"{a} {n // 1024}K {s:.1f} s" for a, n, s in res) + extra)
