"""The engine on a real model on the GPU (--gpu-model PATH or $LONGREACH_GPU_MODEL, e.g. SmolLM2's GGUF at
/tmp/m/model.gguf): CUDA graphs vs eager and chunked prefill, fp32 logits against transformers, and the sparse
backends and MInference through their kernels against their CPU reference paths. The engine tests of offloading,
the box stage and Cascading are in test_offload.py, test_box.py and test_cascading.py."""
from __future__ import annotations

import gc
import os

import torch

from .common import essay_text


def test_graphs_eager_chunked(gpu_model, detail):
    """Greedy decode of four prompts: CUDA-graph decode == eager, token for token (the prefill eager in both: the
    chunk graphs pad its GEMMs, whose other cuBLAS kernels may round otherwise in bf16; test_chunk_graphs_equal_eager
    checks them in fp32); the default engine, chunk graphs on, beside it, and chunked prefill (128-token steps)
    beside the unchunked run (both reported, not asserted)."""
    from longreach import LLM, SamplingParams

    def fresh(**kw):  # a fixed KV pool so that several engines fit on the GPU one after another
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(gpu_model, max_num_seqs=32, kv_cache_memory_gb=4, **kw)

    prompts = ["The history of the Roman Empire", "def quicksort(arr):", "Photosynthesis is " * 40,
               "Once upon a time, " * 100]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = fresh(chunk_graph_max_tokens=0)
    graphed = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    llm = fresh()
    default = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    eager = fresh(enforce_eager=True)
    eager_out = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(graphed, eager_out))
    if same != len(prompts):
        raise AssertionError(f"CUDA-graph decode differs from eager on {len(prompts) - same}/{len(prompts)} prompts")
    del eager
    chunked = fresh(max_num_batched_tokens=128)
    chunk_out = [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)]
    agree = sum(a == b for a, b in zip(graphed, chunk_out))
    with_chunks = sum(a == b for a, b in zip(default, eager_out))
    detail(f"graph == eager on {same}/{len(prompts)}; with the chunk graphs too (bf16) == eager on "
           f"{with_chunks}/{len(prompts)}; chunked-prefill (128) == unchunked on {agree}/{len(prompts)}")


def test_fp32_parity(gpu_model, detail):
    """fp32 prompt logits on the GPU against transformers' on the same GGUF file (--gpu-model must be a GGUF path),
    one sentence 40 times: max |diff| <= 1e-2."""
    from transformers import AutoModelForCausalLM

    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine

    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine(EngineConfig(model=gpu_model, dtype="float32", kv_cache_memory_gb=4))
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    ours = eng.prompt_logits(ids)
    d, f = os.path.split(gpu_model)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    diff = (ours - ref).abs().max().item()
    if diff > 1e-2:
        raise AssertionError(f"max |logit diff| {diff:.2e}")
    detail(f"fp32 on GPU, {len(ids)} tokens: max |logit diff| vs transformers {diff:.2e}")


def test_sparse_backends(gpu_model, detail):
    """Each sparse backend end to end on the GPU (kernels) vs the same backend's CPU reference path, 3K-token prompt
    with small budgets so that selection prunes; greedy tokens should agree."""
    from longreach import LLM, SamplingParams

    cfg = {"infinitehip": '{"n_sink": 64, "n_window": 256, "budgets": [2048, 1024, 256], "early_last_budget": 512}',
           "hip": '{"n_sink": 64, "n_window": 256, "budget": 256}',
           "streaming": '{"n_sink": 64, "n_window": 512}'}
    text = essay_text()
    rows = []
    for name, conf in cfg.items():
        outs = []
        for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(gpu_model, attention=name, attention_config=conf, device=device, dtype=dtype, max_model_len=4096,
                      kv_cache_memory_gb=1, max_num_seqs=1)
            ids = llm.get_tokenizer().encode(text)[:3000]
            outs.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True), use_tqdm=False)[0])
            del llm
        same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
        rows.append(f"{name} {same}/24")
        if same < 20:
            raise AssertionError(f"{name}: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    detail("GPU kernels vs CPU reference, fp32, greedy tokens equal: " + ", ".join(rows))


def test_minference_engine(gpu_model, detail):
    """minference end to end: kernels vs the CPU reference (greedy tokens), and minference prefill + infinitehip
    decode with CUDA graphs == eager."""
    from longreach import LLM, SamplingParams

    text = essay_text()
    conf = '{"pattern": ["vertical_slash", 64, 512], "dense_below": 0}'
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_model, attention="minference", attention_config=conf, device=device, dtype=dtype,
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
        llm = LLM(gpu_model, attention="minference", attention_config=conf, decode_attention="infinitehip",
                  max_model_len=16384, kv_cache_memory_gb=2, max_num_seqs=4, enforce_eager=eager)
        ids = llm.get_tokenizer().encode(text)[:12000]
        composed.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    if composed[0] != composed[1]:
        raise AssertionError("minference + infinitehip decode: CUDA-graph tokens differ from eager")
    detail(f"kernels vs CPU reference {same}/24 tokens; minference + infinitehip decode at 12K: graph == eager")


def test_mixed_steps(gpu_model, detail):
    """Issue 30's mixed steps on the GPU, fp32 (so that rounding cannot flip a greedy token): two chats decode while a
    3,000-token prompt of essays prefills in 256-token steps (its chunks capped at 64 beside them); dense and the
    default infinitehip, eager and with CUDA graphs, each with mixed steps against separate steps: the same greedy
    tokens, and at least one mixed step ran."""
    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.sampling_params import SamplingParams

    rows = []
    for attention, eager in (("dense", True), ("infinitehip", True), ("dense", False), ("infinitehip", False)):
        outs = []  # eager: one forward pass per mixed step; graphs: the decode graph replays, then the prefill chunks
        for mixed in (True, False):
            gc.collect()
            torch.cuda.empty_cache()
            eng = LLMEngine(EngineConfig(model=gpu_model, attention=attention, dtype="float32", max_model_len=4096,
                                         kv_cache_memory_gb=1, max_num_batched_tokens=256, enforce_eager=eager))
            assert eng.scheduler.mixed, f"{attention} should mix decode and prefill on a GPU-resident cache"
            eng.scheduler.mixed = mixed
            ids = eng.tokenizer.encode(essay_text())
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            eng.add_request("a", ids[:40], params)
            eng.add_request("b", ids[100:160], params)
            got, n_mixed = {}, 0
            for step in range(400):
                if step == 3:
                    eng.add_request("long", ids[:3000], params)
                for o in eng.step():
                    got[o.request_id] = o.outputs[0].token_ids
                n_mixed += bool(eng.last_step and eng.last_step.is_prefill and eng.last_step.num_decode_tokens)
                if len(got) == 3:
                    break
            outs.append((got, n_mixed))
            del eng
        (a, n), (b, _) = outs
        if n == 0:
            raise AssertionError(f"{attention}: no mixed step ran")
        same = sum(a[r] == b[r] for r in a)
        rows.append(f"{attention} {'eager' if eager else 'graphs'}: {same}/3 requests equal, {n} mixed steps")
        if same != 3:
            raise AssertionError(f"{attention}: mixed steps changed the greedy tokens of {3 - same}/3 requests")
    detail("; ".join(rows))


def test_chunk_graphs_equal_eager(gpu_model, detail):
    """Prefill steps through the piecewise chunk graphs (engine/chunk_graphs.py: each layer's work around attention
    replayed, attention eager) against the same engine without them (--chunk-graph-max-tokens 0, decode graphs on)
    and against --enforce-eager, fp32 (so that the padded GEMMs' other rounding cannot flip a greedy token), dense
    and the default infinitehip: two chats decode while a 3,000-token prompt of essays prefills in 256-token steps
    (chunks of 64 beside them, 256 when alone: sizes 256 and 64 captured; the chats' 100-token first step pads to
    256). Asserted: the chunk graphs were captured at start-up for exactly those sizes and ran, the three
    runs' greedy tokens are equal, and with dense every step's logits with and without the chunk graphs agree within
    1e-3 (infinitehip's max difference is reported: a near tie in its block selection may go the other way on keys
    that differ in the last bits). Reported: each run's median wall time of the steps that carried prefill (one run
    each, not a benchmark)."""
    import statistics

    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.sampling_params import SamplingParams

    rows = []
    for attention in ("dense", "infinitehip"):
        runs = {}
        for name, kw in (("chunk graphs", {}), ("none", {"chunk_graph_max_tokens": 0}),
                         ("eager", {"enforce_eager": True})):
            gc.collect()
            torch.cuda.empty_cache()
            eng = LLMEngine(EngineConfig(model=gpu_model, attention=attention, dtype="float32", max_model_len=4096,
                                         kv_cache_memory_gb=1, max_num_batched_tokens=256, **kw))
            graphs = eng.runner.chunk_graphs
            if name == "chunk graphs" and (graphs is None or graphs.sizes != [64, 256]):
                raise AssertionError(f"{attention}: chunk graphs captured at start-up for sizes "
                                     f"{graphs and graphs.sizes}, expected [64, 256]")
            if name != "chunk graphs" and graphs is not None:
                raise AssertionError(f"{attention}: chunk graphs captured with {kw}")
            logits, inner = [], eng.runner.execute

            def execute(batch, all_logits=False, inner=inner, logits=logits):
                out, idx = inner(batch, all_logits)
                logits.append(out.clone())
                return out, idx
            eng.runner.execute = execute
            ids = eng.tokenizer.encode(essay_text())
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            eng.add_request("a", ids[:40], params)
            eng.add_request("b", ids[100:160], params)
            got, prefill_s = {}, []
            for step in range(400):
                if step == 3:
                    eng.add_request("long", ids[:3000], params)
                for o in eng.step():
                    got[o.request_id] = o.outputs[0].token_ids
                if eng.last_step is not None and eng.last_step.is_prefill:
                    prefill_s.append(eng.last_step.seconds)
                if len(got) == 3:
                    break
            runs[name] = (got, logits, statistics.median(prefill_s), graphs.runs if graphs else 0)
            del eng, graphs
        (got, logits, graph_s, n_runs), (none, none_logits, none_s, _), (eager, _, eager_s, _) = \
            runs["chunk graphs"], runs["none"], runs["eager"]
        if n_runs == 0:
            raise AssertionError(f"{attention}: no prefill step ran through the chunk graphs")
        if len(logits) != len(none_logits):
            raise AssertionError(f"{attention}: {len(logits)} steps with the chunk graphs, {len(none_logits)} without")
        if any(a.shape != b.shape for a, b in zip(logits, none_logits)):
            raise AssertionError(f"{attention}: the steps sampled different rows with and without the chunk graphs")
        diff = max(((a - b).abs().max().item() for a, b in zip(logits, none_logits) if a.numel()), default=0.0)
        same = [sum(got[r] == other[r] for r in got) for other in (none, eager)]
        rows.append(f"{attention}: tokens equal {same[0]}/3 vs none, {same[1]}/3 vs eager; max |logit diff| vs none "
                    f"{diff:.2e}; {n_runs} chunk-graph steps; median prefill-step wall ms graphs {1e3 * graph_s:.1f} / "
                    f"none {1e3 * none_s:.1f} / eager {1e3 * eager_s:.1f}")
        if same != [3, 3] or (attention == "dense" and diff > 1e-3):
            raise AssertionError(rows[-1])
    detail("; ".join(rows))


def test_prefill_selection_graphs(gpu_model, detail):
    """The prefill chunks' selection replayed from CUDA graphs (attention/sparse/prefill_graph.py) against the eager
    selection, default infinitehip, bf16: a 24K-token prompt of essays in 2,048-token chunks, prompt logits within
    bf16 noise of the eager run (the same blocks are selected; max |diff| <= 0.05) and the greedy continuation equal
    over 16 tokens; the graphs captured up front (as the server's warm-up does) are every one the chunks use; the
    prefill's wall time both ways is reported (the graph run's second prompt)."""
    import time

    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.sampling_params import SamplingParams

    runs = {}
    for graphs in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        # dense_below 0: the default attends exactly inside the model's trained context (32K for Qwen2.5-Coder),
        # which would leave this 24K prompt nothing to select
        eng = LLMEngine(EngineConfig(model=gpu_model, attention="infinitehip", max_model_len=32768,
                                     kv_cache_memory_gb=4, max_num_batched_tokens=2048,
                                     attention_config={"dense_below": 0}))
        pg = eng.backend.prefill_graphs
        assert pg.enabled, "prefill graphs should be on for infinitehip on a GPU"
        pg.enabled = graphs
        up_front = eng.runner.capture_prefill_graphs([2048]) if graphs else 0  # the server's warm-up does this
        ids = eng.tokenizer.encode(essay_text() * 8)[:24000]
        logits = eng.prompt_logits(ids)
        if graphs and pg.captures != up_front:
            raise AssertionError(f"the prompt's chunks captured {pg.captures - up_front} graphs beyond the "
                                 f"{up_front} captured up front")
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        eng.add_request("g", ids, params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o.outputs[0].token_ids
        torch.cuda.synchronize()
        runs[graphs] = (logits, out, time.perf_counter() - t0, pg.replays, pg.captures, pg.disabled_why)
        del eng
    (l0, t0_, s0, _, _, _), (l1, t1, s1, replays, captures, why) = runs[False], runs[True]
    if why is not None or replays == 0:
        raise AssertionError(f"the prefill graphs did not run: replays {replays}, disabled: {why}")
    diff = (l0.float() - l1.float()).abs().max().item()
    detail(f"prompt logits max |diff| {diff:.4f}; tokens equal {t0_ == t1}; prefill+16 tokens eager selection "
           f"{s0:.2f} s, graphs {s1:.2f} s; {captures} graphs captured, {replays} replays")
    if diff > 0.05 or t0_ != t1:
        raise AssertionError(f"graph-replayed prefill selection differs from eager: max |diff| {diff:.4f}, tokens "
                             f"equal {t0_ == t1}")


def test_dense_paged_prefill_equals_sdpa(gpu_model, detail, monkeypatch):
    """--dense-prefill paged (attention/dense.py: each chunk's cached prefix read in place by the block-sparse kernel)
    against the default sdpa path, dense, bf16: a 20K-token prompt of essays in 2,048-token chunks. The two paths
    round differently (another summation order, split-K merges, cuDNN vs Triton), so "equal" is judged against what
    bf16 allows: the same prompt in fp32 (sdpa) is the reference, and the paged run's max |logit error| against it
    must be at most twice the sdpa run's own plus 0.05 (tests/test_dense_paged_prefill.py checks the paths agree to
    1e-4 in fp32 on a CPU); the greedy 16 tokens after the prompt are equal where sdpa's equal fp32's. Reported:
    the logit errors, and each path's prefill wall time (one run, not a benchmark)."""
    import time

    import longreach.attention.dense as dense_mod
    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.sampling_params import SamplingParams

    launches = [0]
    paged_kernel = dense_mod.paged_prefix_attention

    def counted(*args, **kwargs):
        launches[0] += 1
        return paged_kernel(*args, **kwargs)

    monkeypatch.setattr(dense_mod, "paged_prefix_attention", counted)  # which path ran: paged launches it per layer
    runs = {}
    for name, kw in (("fp32", dict(dtype="float32")), ("sdpa", {}), ("paged", dict(dense_prefill="paged"))):
        launches[0] = 0
        gc.collect()
        torch.cuda.empty_cache()
        eng = LLMEngine(EngineConfig(model=gpu_model, attention="dense", max_model_len=32768, kv_cache_memory_gb=4,
                                     max_num_batched_tokens=2048, **kw))
        ids = eng.tokenizer.encode(essay_text() * 8)[:20000]
        logits = eng.prompt_logits(ids)[2048:].float()  # the rows of the chunks with a prefix
        eng.add_request("g", ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        torch.cuda.synchronize()
        t0, prefill_s, out = time.perf_counter(), 0.0, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o.outputs[0].token_ids
            torch.cuda.synchronize()
            if eng.last_step is not None and eng.last_step.is_prefill:
                prefill_s = time.perf_counter() - t0
        if (name == "paged") != (launches[0] > 0):
            raise AssertionError(f"{name}: the paged prefill {'did not run' if name == 'paged' else 'ran'} "
                                 f"({launches[0]} launches)")
        runs[name] = (logits, out, prefill_s)
        del eng
    (ref, ref_tokens, _), (sdpa, sdpa_tokens, sdpa_s), (paged, paged_tokens, paged_s) = \
        runs["fp32"], runs["sdpa"], runs["paged"]
    err_sdpa = (sdpa - ref).abs().max().item()
    err_paged = (paged - ref).abs().max().item()
    diff = (paged - sdpa).abs().max().item()
    detail(f"max |logit error| vs fp32: sdpa {err_sdpa:.4f}, paged {err_paged:.4f} (paged vs sdpa {diff:.4f}); "
           f"greedy 16 tokens equal {paged_tokens == sdpa_tokens} (fp32's equal to sdpa's "
           f"{ref_tokens == sdpa_tokens}); prefill wall s sdpa {sdpa_s:.2f}, paged {paged_s:.2f}")
    # token equality is asked only where bf16 sdpa keeps fp32's greedy path: where sdpa itself leaves it, two bf16
    # paths may part anywhere and the logit bound is the judge (the first GPU run, Qwen2.5-Coder-0.5B at 8d5d1a8,
    # failed on tokens alone: fp32 and sdpa parted too, and the paged run's logit error was the smaller, 0.99 vs 1.48;
    # docs/results/gpu-tests-h200-paged-prefill.json)
    tokens_ok = paged_tokens == sdpa_tokens or ref_tokens != sdpa_tokens
    if err_paged > 2 * err_sdpa + 0.05 or not tokens_ok:
        raise AssertionError(f"the paged prefill differs from sdpa beyond bf16 noise: error vs fp32 {err_paged:.4f} "
                             f"against sdpa's {err_sdpa:.4f}, tokens equal {paged_tokens == sdpa_tokens}")
