"""Helpers shared by the GPU tests (and scripts/fp8_gemv_sweep.py): error measures, RoPE frequencies, random paged
caches, two-tier caches, timing (eager, and inside CUDA graphs over more weights than the L2 cache holds), the essay
text."""
from __future__ import annotations

import gc
import os

import torch


def rel_err(out, ref) -> float:
    """|out - ref| / |ref| (Frobenius norms) in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def llama_inv_freq(D: int) -> torch.Tensor:
    """Llama-3's RoPE frequencies (theta 500,000) for head size D, on the GPU: (D // 2,)."""
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq

    return rope_inv_freq(RopeConfig(theta=500000.0), D)[0].cuda()


def random_paged_kv(dev, g, lengths, page: int, Hkv: int, D: int, dtype=torch.bfloat16, spare: int = 4):
    """Random K/V (P, page, H_kv, D) holding sequences of `lengths` tokens in pages scattered at random (`spare`
    pages more, owned by none), and their block tables (n, most pages) int32: (kc, vc, tables)."""
    need = [-(-x // page) for x in lengths]
    kc = torch.randn(sum(need) + spare, page, Hkv, D, device=dev, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(kc.shape[0], device=dev, generator=g).int()
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=dev)
    first = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[first:first + n]
        first += n
    return kc, vc, tables


def random_fp8_key_pages(dev, g, tokens: int, page: int, Hkv: int, D: int):
    """Random fp8 key rows with their scales (kernels/fp8.py's layout) for `tokens` tokens in pages scattered at
    random, and the one sequence's block table: (kc (P, page, H_kv, D + 16) float8_e4m3fn, table (P,) int32). The
    scoring scripts' 1M shape (scripts/score_kernels_sweep.py, scripts/rotation_ab.py)."""
    from longreach.kernels.fp8 import encode

    pages = -(-tokens // page)
    table = torch.randperm(pages, device=dev, generator=g).int()
    kc = torch.empty(pages, page, Hkv, D + 16, dtype=torch.float8_e4m3fn, device=dev)
    for i in range(0, pages, 4096):  # written in slices
        kc[i:i + 4096] = encode(torch.randn(min(4096, pages - i), page, Hkv, D, device=dev, generator=g),
                                torch.float8_e4m3fn)
    return kc, table


def two_tier(kc, vc, share, g, units=1):
    """A two-tier copy of one-tier caches kc/vc (P, page, H_kv, D): host pinned, `share` of the pages (with `units` =
    H_kv: of the KV heads' pages, kvcache/offload.py's head units) resident in a pool at random slots (the rest read
    over PCIe)."""
    from longreach.kvcache.offload import TierView

    P, page, H, D = kc.shape
    cells = P * units
    res = torch.randperm(cells, device=kc.device, generator=g)[: int(cells * share)]
    S = res.numel() + 3
    slot = torch.randperm(S, device=kc.device, generator=g)[: res.numel()]
    slots = torch.full((cells,), -1, dtype=torch.int32, device=kc.device)
    slots[res] = slot.int()
    views = []
    for c in (kc, vc):
        per_cell = c if units == 1 else c.transpose(1, 2).reshape(cells, page, 1, D)
        pool = torch.randn(S + 1, *per_cell.shape[1:], device=c.device, generator=g).to(c.dtype)  # junk elsewhere
        pool[slot] = per_cell[res]
        if units == 1:
            views.append(TierView(pool, c.cpu().pin_memory(), slots))
        else:
            host = c.transpose(1, 2).contiguous().cpu().pin_memory()  # (P, H_kv, page, D)
            views.append(TierView(pool, host, slots.view(P, H), units))
    return views


def median_us(fn, reps: int = 50) -> float:
    """The median time of fn() in microseconds, by CUDA events around each call (3 warm-up calls first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[reps // 2]


def graph_us(fns, reps: int = 20) -> float:
    """Median microseconds per call of `fns`, captured one after another in one CUDA graph, as a decode step runs its
    layers (no launch overhead between them; where each reads other weights, the L2 cache holds none of them)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return median_us(graph.replay, reps=reps) / len(fns)


def l2_copies(nbytes: int) -> int:
    """How many copies of a weight of `nbytes` make three times the L2 cache (at least 2, at most 32)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, min(32, -(-3 * l2 // nbytes)))


def gpu_and_cpu_tokens(gpu_model, attention: str, attention_config: str, check=None, prompt_tokens: int = 3000,
                       max_tokens: int = 24) -> list[list[int]]:
    """Greedy tokens of the essays' first `prompt_tokens` tokens through the engine with `attention` on the GPU
    (kernels) and on the CPU (the references), fp32 both: [GPU tokens, CPU tokens]. check(llm), if given, runs on
    each engine before it generates."""
    from longreach import LLM, SamplingParams

    outs = []
    for device in ("cuda", "cpu"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_model, attention=attention, attention_config=attention_config, device=device, dtype="float32",
                  max_model_len=4096, kv_cache_memory_gb=1, max_num_seqs=1)
        if check is not None:
            check(llm)
        ids = llm.get_tokenizer().encode(essay_text())[:prompt_tokens]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    return outs


def essay_text() -> str:
    """The Paul Graham essays: from .carry/b/pg.txt where a device call carried them, else longreach's copy."""
    from longreach.tools.eval.data import paul_graham_text

    if os.path.exists(".carry/b/pg.txt"):
        with open(".carry/b/pg.txt") as f:
            return f.read()
    return paul_graham_text()
