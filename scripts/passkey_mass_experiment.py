"""Experiment (docs/quality.md, "Passkey"): does the softmax mass of the keys infinitehip drops explain its passkey
failures, and does an estimate of that mass fix them?

Runs the real engine and infinitehip's real selection, but replaces the block-sparse executor with dense math over
the same selection, so the dropped keys can be treated in several ways (MODE):
  renorm      what the engine does: softmax over the selected keys only
  nonorm      oracle: softmax over all keys, output from the selected ones (the dropped mass stays in the denominator)
  strideK     every K-th dropped key, weighted by K, stands in for the dropped ones (K-th position; aliasing-prone)
  strideKd    the same in the denominator only
  hashK       dropped keys whose hashed position is 0 mod K, weight K
  fixedN      N samples spread over each row's dropped keys, weight (dropped / N)
  cmeanC      one summary key and value per C-token chunk: the mean of its dropped keys, weight = their count
Inside the trained length only (the patched executor keeps true positions; it ignores the RoPE strategies).

  python scripts/passkey_mass_experiment.py LENGTH MODE[,MODE...] SEEDS MODEL   (DEPTHS=0.1,0.5,0.9 in the env)
"""
import os
import sys

import torch

from longreach.engine.llm import LLM
from longreach.sampling_params import SamplingParams
from longreach.eval.passkey import passkey_prompt, score
import longreach.attention.sparse.backend as sp
from longreach.kvcache.paged import gather_tokens

MODE = "renorm"
def patched(q, k_cache, v_cache, block_tables, index, scale, max_bytes=0, rope=None):
    qb = index.queries; T, Hq, D = q.shape; Hkv = k_cache.shape[2]; gqa = Hq // Hkv; G = index.groups
    assert G == Hkv
    dev = q.device
    out = torch.zeros_like(q)
    S, W, BK = index.n_sink, index.n_window, index.block_k
    for b in range(qb.num_blocks):
        seq = qb.seq[b]; st, n, p0 = qb.start[b], qb.length[b], qb.pos[b]
        Lk = p0 + n
        K = gather_tokens(k_cache, block_tables[seq], Lk).float().repeat_interleave(gqa, 1)  # (Lk, Hq, D)
        V = gather_tokens(v_cache, block_tables[seq], Lk).float().repeat_interleave(gqa, 1)
        kpos = torch.arange(Lk, device=dev)
        p = p0 + torch.arange(n, device=dev)
        causal = kpos[None, :] <= p[:, None]  # (n, Lk)
        sel = torch.zeros(G, Lk, dtype=torch.bool, device=dev)
        ids = index.blocks[b].long()
        for g in range(G):
            i = ids[g][ids[g] >= 0]
            pos = (i[:, None] * BK + torch.arange(BK, device=dev)).flatten()
            sel[g, pos[pos < Lk]] = True
        selh = sel.repeat_interleave(Hq // G, 0)  # (Hq, Lk)
        base = (kpos[None, :] < S) | (kpos[None, :] > p[:, None] - W)  # (n, Lk)
        allowed = causal[None] & (base[None] | (selh[:, None, :] & (kpos[None, None, :] <= p[None, :, None] - W)))
        s = torch.einsum("nhd,khd->hnk", q[st:st + n].float(), K) * scale
        s = s.masked_fill(~causal[None], float("-inf"))
        drop = causal[None] & ~allowed
        if MODE == "renorm":
            w = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        elif MODE == "nonorm":
            w = torch.softmax(s, -1) * allowed
        elif MODE.startswith("stride"):  # stride16 / stride16d (denominator only)
            k = int(MODE[6:].rstrip("d"))
            samp = drop & (kpos % k == 0)
            lw = torch.where(allowed, s, torch.where(samp, s + torch.log(torch.tensor(float(k))), float("-inf")))
            w = torch.softmax(lw, -1)
            if MODE.endswith("d"):
                w = w * allowed
        elif MODE.startswith("hash"):  # hashK: dropped keys whose hashed position is 0 mod K, weight K
            k = int(MODE[4:])
            samp = drop & (((kpos * 2654435761) % 4294967296) % k == 0)
            lw = torch.where(allowed, s, torch.where(samp, s + torch.log(torch.tensor(float(k))), float("-inf")))
            w = torch.softmax(lw, -1)
        elif MODE.startswith("cmean"):  # cmeanC: one summary key/value per C-token chunk: mean of its dropped keys
            C = int(MODE[5:])
            nc = -(-Lk // C)
            pad = nc * C - Lk
            dp = torch.nn.functional.pad(drop.float(), (0, pad)).reshape(Hq, n, nc, C)
            Kp = torch.nn.functional.pad(K, (0, 0, 0, 0, 0, pad)).reshape(nc, C, Hq, D)
            Vp = torch.nn.functional.pad(V, (0, 0, 0, 0, 0, pad)).reshape(nc, C, Hq, D)
            cnt = dp.sum(-1)  # (H, n, nc)
            km = torch.einsum("hncj,cjhd->hncd", dp, Kp) / cnt.clamp(min=1)[..., None]
            vm = torch.einsum("hncj,cjhd->hncd", dp, Vp) / cnt.clamp(min=1)[..., None]
            sm = torch.einsum("nhd,hncd->hnc", q[st:st + n].float(), km) * scale + torch.log(cnt)  # -inf where empty
            sa = s.masked_fill(~allowed, float("-inf"))
            w2 = torch.softmax(torch.cat([sa, sm], -1), -1)
            o = torch.einsum("hnk,khd->nhd", w2[..., :Lk], V) + torch.einsum("hnc,hncd->nhd", w2[..., Lk:], vm)
            out[st:st + n] = o.to(q.dtype)
            continue
        elif MODE.startswith("fixed"):  # fixedN: N samples spread over the dropped keys, weight n_drop / N
            N = int(MODE[5:])
            nd = drop.sum(-1, keepdim=True).float()  # (H, n, 1)
            rank = drop.cumsum(-1)  # 1-based rank among dropped keys
            stride = (nd / N).clamp(min=1)
            samp = drop & (torch.remainder(rank - 1, stride) < 1)
            cnt = samp.sum(-1, keepdim=True).clamp(min=1)
            lw = torch.where(allowed, s, torch.where(samp, s + torch.log(nd / cnt), float("-inf")))
            w = torch.softmax(lw, -1)
        o = torch.einsum("hnk,khd->nhd", w, V)
        out[st:st + n] = o.to(q.dtype)
    return out, torch.zeros(T, Hq, device=dev)

sp.block_sparse_attention = patched
orig_use = sp.use_kernels
sp.use_kernels = lambda t: False if sys._getframe(1).f_code.co_name == "forward" else orig_use(t)
L = int(sys.argv[1]); modes = sys.argv[2].split(","); seeds = int(sys.argv[3])
res = {}
for MODE in modes:
    llm = LLM(sys.argv[4], attention="infinitehip", device="cuda", max_model_len=L + 16, kv_cache_memory_gb=4)
    ok = 0; outs = []
    for seed in range(seeds):
        for depth in [float(x) for x in os.environ.get("DEPTHS", "0.1,0.3,0.5,0.7,0.9").split(",")]:
            ids, key = passkey_prompt(llm.get_tokenizer(), L, depth, seed)
            o = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].text
            ok += score(o, key); outs.append("Y" if score(o, key) else ".")
            print(MODE, L, seed, depth, key, repr(o), flush=True)
    print(MODE, L, "".join(outs), f"{ok}/{len(outs)}", flush=True)
    del llm; torch.cuda.empty_cache()
