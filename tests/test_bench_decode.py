"""Random-weight models (`random:<shape>`) and `longreach bench decode`, on CPU at toy sizes.

Timings here mean nothing; the tests guard the shapes, the code paths a GPU session relies on (per-step timing,
the dense column and its extrapolation, offload counters, the JSON and the table) and the error messages.
"""
import dataclasses
import json

import pytest
import torch

from longreach import SamplingParams
from longreach.config import EngineConfig
from longreach.engine.llm import LLM
from longreach.models.config import ModelConfig, RopeConfig
from longreach.models.llama import LlamaForCausalLM
from longreach.models.random_init import SHAPES, random_shape

SMALL = json.dumps({  # budgets far below the toy contexts, so that the sparse paths really run (tests/test_sparse.py)
    "infinitehip": {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8],
                    "early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0},
    "streaming": {"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0},
})
LLAMA_31_8B_CONFIG_JSON = {  # meta-llama/Llama-3.1-8B/config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def test_llama_3_1_8b_shape_is_the_checkpoints():
    cfg = random_shape("random:llama-3.1-8b").config
    hf = ModelConfig.from_hf(LLAMA_31_8B_CONFIG_JSON)
    assert cfg == dataclasses.replace(hf, name="random:llama-3.1-8b", bos_token_id=None, eos_token_ids=())
    assert cfg.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)
    with torch.device("meta"):  # shapes only
        assert sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) == 8_030_261_248


def test_random_tiny_loads_with_its_shapes_gives_finite_logits_and_generates_without_a_tokenizer():
    llm = LLM("random:tiny", device="cpu", dtype="float32", max_model_len=512)
    engine, model = llm.engine, llm.engine.model
    cfg = SHAPES["tiny"].config
    assert engine.model_config == cfg and engine.tokenizer is None
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.weight.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert model.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size) and len(model.layers) == cfg.num_layers
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert bool((model.norm.weight == 1).all()) and 0.015 < float(model.embed_tokens.weight.detach().std()) < 0.025
    ids = torch.randint(100, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = llm.engine.prompt_logits(ids)
    assert logits.shape == (200, cfg.vocab_size) and bool(torch.isfinite(logits).all()) and float(logits.std()) > 0
    again = LLM("random:tiny", device="cpu", dtype="float32", max_model_len=512)  # seeded: the same weights
    assert torch.equal(again.engine.model.layers[1].mlp.down_proj.weight, model.layers[1].mlp.down_proj.weight)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.text == "" and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_unknown_random_shape_is_a_clear_error(capsys):
    from longreach.cli import main

    with pytest.raises(ValueError, match=r"unknown random model shape 'llama-9b'; available: random:llama-3.1-8b, "
                                         r"random:gemma-3-12b, random:tiny"):
        LLM("random:llama-9b", device="cpu")
    assert main(["bench", "decode", "--model", "random:nope", "--device", "cpu"]) == 2
    assert "unknown random model shape 'nope'" in capsys.readouterr().err


def test_bench_decode_end_to_end_on_cpu(tmp_path, capsys, monkeypatch):
    import gc

    import longreach.engine.heap as heap
    from longreach.cli import main

    frozen = []  # each engine's heap is frozen after its warm-up (as the server's) and unfrozen when it is freed
    freeze = heap.freeze_heap
    monkeypatch.setattr(heap, "freeze_heap", lambda: (freeze(), frozen.append(gc.get_freeze_count())))
    out = tmp_path / "bench-decode.json"
    rc = main(["bench", "decode", "--model", "random:tiny", "--lengths", "256", "384", "--attention", "infinitehip",
               "streaming", "--attention-config", SMALL, "--decode-tokens", "6", "--dense-lengths", "128", "256",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert len(frozen) >= 4 and min(frozen) > 1000 and gc.get_freeze_count() == 0, frozen
    assert {"note", "model", "gpu", "date", "command", "torch", "settings", "host", "runs", "dense",
            "dense_extrapolation"} <= set(r)
    assert r["note"] == "random fp32 weights in the tiny Llama shape (CPU tests)" and r["gpu"] == "cpu"
    assert r["command"].startswith("longreach bench decode --model random:tiny --lengths 256 384")
    assert [(x["context"], x["attention"]) for x in r["runs"]] == [
        (256, "infinitehip"), (256, "streaming"), (384, "infinitehip"), (384, "streaming")]
    assert [(d["context"], d["status"]) for d in r["dense"]] == [(128, "measured"), (256, "measured")]
    for x in r["runs"]:
        assert "error" not in x, x
        assert x["decode_steps"] == 5 and x["decode_tok_s"] > 0 and x["prefill_s"] > 0
        assert x["kv_cache_dtype"] == "float32" and not x["offload"]
        mem = x["memory"]
        assert mem["weights_bytes"] == 4 * sum(p.numel() for p in LlamaForCausalLM(SHAPES["tiny"].config).parameters())
        assert mem["kv_gpu_bytes"] > 0 and {"kv_host_bytes", "workspace_bytes", "peak_allocated_bytes"} <= set(mem)
        assert x["host"]["rss_bytes"] > 0
        # the rate says which steps it counts: without graphs on a CPU, every step but the first (eager warm-up)
        assert x["steps_counted"] == 4 and x["steps_excluded"] == {"first_eager": [0]}
        assert all(0 <= i < 5 and g in (0, 1, 2) and ms >= 1 for i, g, ms in x["gc_pauses"])
        assert x["prefill_steps_counted"] >= 1
        if x["context"] == 256:
            assert x["dense_source"] == "measured" and x["ratio_to_dense"] > 0 and x["extrapolated"] == []
        else:  # dense ran at 128 and 256 only: 384 is extrapolated (when the toy timings give a rising line)
            assert x["dense_source"].startswith("extrapolated" if r["dense_extrapolation"] else "not measured")
            assert x["extrapolated"] == (["dense_tok_s", "ratio_to_dense"] if r["dense_extrapolation"] else [])
    prov = r["provenance"]  # tools/report.py's record
    assert prov["command"] == r["command"] and prov["device"] == "cpu" and prov["commit"] and prov["date"]
    assert [(a["label"], a["preset"]) for a in prov["attention"]] == [
        ("infinitehip", "3k-box"), ("streaming", "3k"), ("dense", None)]
    assert prov["attention"][0]["attention_config"]["n_sink"] == 8 and prov["samples"]["n"] == 1
    table = capsys.readouterr().out
    assert "random fp32 weights in the tiny Llama shape" in table and "decode tok/s" in table and "dense tok/s" in table
    assert "left out per row" in table and "first_eager 0" in table


@pytest.mark.skipif("kv_offloading_size" not in EngineConfig.field_names(), reason="needs the KV offload store")
def test_bench_decode_reports_offload_counters(tmp_path):
    from longreach.tools.bench.decode import run
    from longreach.tools.eval.common import parse_methods

    engine = {"device": "cpu", "dtype": "float32", "attention_config": SMALL, "kv_offloading_size": 0.01,
              "kv_cache_memory_gb": 0.00005}  # a GPU tier of ~13 one-layer pages: most reads miss
    r = run("random:tiny", [384], parse_methods(["infinitehip"]), engine, decode_tokens=6, dense_lengths=[],
            out_path=str(tmp_path / "b.json"))
    x = r["runs"][0]
    assert "error" not in x, x
    assert x["offload"] and x["memory"]["kv_host_bytes"] > 0 and not r["dense"]
    off = x["offload_stats"]
    assert off["decode"]["pages_missed"] > 0 and off["decode"]["bytes_h2d"] > 0 and 0 <= off["hit_ratio"] < 1
    assert off["h2d_gb_s"] > 0 and set(off["prefill"]) >= {"pages_hit", "pages_missed", "bytes_h2d"}
    assert len(off["per_step"]) == len(x["step_s"])  # each step's installs, in step order; the counted ones sum up
    counted = [s for i, s in enumerate(off["per_step"]) if i not in x["warmup_step_indices"]]
    assert sum(s["bytes_h2d"] for s in counted) == off["decode"]["bytes_h2d"]
    assert sum(s["pages_installed"] for s in counted) == off["decode"]["pages_installed"]
    assert x["dense_source"].startswith("not measured")


def test_dense_extrapolation_is_the_line_through_the_largest_and_smallest_dense_contexts():
    from longreach.tools.bench.decode_report import _fill_dense_column, dense_fit

    dense = [{"context": n, "status": "measured", "step_s_mean": t, "decode_tok_s": 1 / t}
             for n, t in ((4096, 0.010), (131072, 0.0125), (524288, 0.020))]
    dense.append({"context": 1 << 20, "status": "does not fit", "reason": "KV 64 GiB > free"})
    fit = dense_fit(dense)
    assert (fit["L0"], fit["L1"]) == (524288, 4096)
    report = {"dense": dense, "runs": [{"context": 1 << 20, "batch": 1, "decode_tok_s": 80.0},
                                       {"context": 131072, "batch": 1, "decode_tok_s": 90.0}]}
    _fill_dense_column(report)
    far, near = report["runs"]
    t = 0.020 + ((1 << 20) - 524288) * (0.020 - 0.010) / (524288 - 4096)
    assert far["dense_source"] == "extrapolated" and far["dense_tok_s"] == pytest.approx(1 / t)
    assert far["ratio_to_dense"] == pytest.approx(80 * t)
    assert near["dense_source"] == "measured" and near["dense_tok_s"] == pytest.approx(80.0)
    assert dense_fit(dense[:1]) is None


@pytest.mark.parametrize("kv_dtype", ["fp8", "bfloat16", "auto"])
def test_bench_kv_bytes_per_token_match_the_stores(kv_dtype):
    """bench decode sizes each run's host tier (and the dense GPU KV) from its own per-token bytes: they must be the
    stores' (an fp8 row is 128 values + a 16-byte scale area, not + 4: the first GPU run refused its own tier)."""
    from longreach.tools.bench.decode_memory import _kv_bytes_per_token
    from longreach.engine.llm_engine import resolve_kv_dtype
    from longreach.kvcache.offload import OffloadedKVCache
    from longreach.kvcache.paged import PagedKVCache

    mc = random_shape("random:llama-3.1-8b").config
    dt = resolve_kv_dtype(kv_dtype, torch.bfloat16)
    args = (mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, dt)
    assert _kv_bytes_per_token(mc, kv_dtype, torch.bfloat16) * 16 == OffloadedKVCache.bytes_per_page(*args)
    assert _kv_bytes_per_token(mc, kv_dtype, torch.bfloat16) * 16 == PagedKVCache.bytes_per_block(*args)


def test_composed_method_decodes_with_its_decode_method(tmp_path):
    """"streaming+psa" in --attention: streaming prefills, psa decodes (the engine's backend says so and psa's block
    metadata exists); before this was wired, bench decode dropped the "+psa" part and measured streaming twice."""
    from longreach.cli import main

    out = tmp_path / "bd.json"
    rc = main(["bench", "decode", "--model", "random:tiny", "--lengths", "256", "--attention", "streaming",
               "streaming+psa", "--attention-config", SMALL, "--decode-tokens", "4", "--dense-lengths",
               "--device", "cpu", "--warmup-tokens", "0", "--out", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(x["attention"], x["backend"], x["decode_attention"]) for x in runs] == [
        ("streaming", "streaming", None), ("streaming+psa", "streaming+psa", "psa")], runs


def test_profile_steps_are_profiled_and_left_out_of_the_rate(tmp_path):
    """--profile-steps 3: the last 3 decode steps run under torch.profiler (a kernel table in the JSON) and count as
    warm-up steps, not in the rate."""
    from longreach.tools.bench.decode import run
    from longreach.tools.eval.common import RunSpec

    out = tmp_path / "bd.json"
    report = run("random:tiny", [512], [RunSpec("streaming", None, "streaming")],
                 {"device": "cpu", "kv_cache_memory_gb": 0.01}, decode_tokens=8, dense_lengths=[],
                 out_path=str(out), warmup_tokens=0, profile_steps=3, profile_trace=str(tmp_path / "traces"))
    row = report["runs"][0]
    # --profile-trace: the profiled steps' timeline as a Chrome trace, named after the run
    trace = json.loads((tmp_path / "traces" / "512-streaming-decode.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert row["decode_steps"] == 7
    assert row["warmup_step_indices"][-3:] == [4, 5, 6]
    prof = row["profile"]
    assert prof["steps"] == 3 and prof["clock"] == "cpu" and prof["top"]
    assert prof["top"][0]["ms_per_step"] >= prof["top"][-1]["ms_per_step"] > 0
    assert json.loads(out.read_text())["runs"][0]["profile"]["steps"] == 3
    parts = prof["breakdown_ms_per_step"]  # the costs sum to the wall time, the device part to the busy time
    assert sum(parts.values()) == pytest.approx(prof["wall_ms_per_step"])
    assert sum(v for k, v in parts.items() if k != "host") == pytest.approx(prof["busy_ms_per_step"])
    assert parts["weights"] > 0  # the model's linear layers (aten::linear on a CPU)


def test_profile_breakdown_sorts_kernels_into_the_documented_costs():
    """Kernel names from a GPU profile (docs/results' 32K and 1M tables) land in their categories, the first match
    winning; the rest is `other`, wall - device is `host`."""
    from longreach.tools.bench.profile import breakdown

    rows = [("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 1.8), ("_chunk_score_kernel", 0.6), ("_topk_kernel", 0.4),
            ("_exact_rows_kernel", 0.3),
            ("_bsa_kernel", 0.5), ("_copy_chunks_kernel", 17.4), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0.9),
            ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 0.1), ("_add_rms_norm_kernel", 0.15),
            ("_box_build_kernel", 0.2), ("_store_kv_kernel", 0.05)]
    parts = breakdown([{"name": n, "ms_per_step": t} for n, t in rows], 25.0)
    assert parts["weights"] == pytest.approx(1.9) and parts["selection"] == pytest.approx(1.5)
    assert parts["attention"] == pytest.approx(0.5) and parts["kv_movement"] == pytest.approx(17.45)
    assert parts["communication"] == pytest.approx(0.9) and parts["other"] == pytest.approx(0.15)
    assert parts["host"] == pytest.approx(25.0 - 22.4) and sum(parts.values()) == pytest.approx(25.0)


def test_profile_prefill_steps_profile_prefill_steps_two_on(tmp_path, capsys):
    """--profile-prefill-steps 2 over a 4-chunk prefill: prefill steps 2 and 3 run under the profiler (a kernel table
    of its own in the JSON), decode is not profiled, and a negative count is a clear error."""
    from longreach.tools.bench.decode import run
    from longreach.cli import main
    from longreach.tools.eval.common import RunSpec

    report = run("random:tiny", [512], [RunSpec("streaming", None, "streaming")],
                 {"device": "cpu", "kv_cache_memory_gb": 0.01, "max_num_batched_tokens": 128}, decode_tokens=4,
                 dense_lengths=[], out_path=str(tmp_path / "bd.json"), warmup_tokens=0, profile_prefill_steps=2)
    row = report["runs"][0]
    assert "error" not in row, row
    prof = row["prefill_profile"]
    assert prof["steps"] == 2 and prof["clock"] == "cpu" and prof["top"] and row["profile"] is None
    assert prof["wall_ms_per_step"] > 0 and row["decode_steps"] == 3 and row["prefill_profiled_from_token"] == 128
    # --profile-prefill-at: from the first step that starts past that share of the prompt (here the last, 384 of 512)
    late = run("random:tiny", [512], [RunSpec("streaming", None, "streaming")],
               {"device": "cpu", "kv_cache_memory_gb": 0.01, "max_num_batched_tokens": 128}, decode_tokens=4,
               dense_lengths=[], out_path=str(tmp_path / "bd2.json"), warmup_tokens=0, profile_prefill_steps=2,
               profile_prefill_at=0.6)["runs"][0]
    assert late["prefill_profile"]["steps"] == 1 and late["prefill_profiled_from_token"] == 384
    assert main(["bench", "decode", "--model", "random:tiny", "--lengths", "256", "--profile-prefill-at", "1",
                 "--device", "cpu"]) == 2
    assert "--profile-prefill-at is a share of the prompt tokens in [0, 1), got 1.0" in capsys.readouterr().err
    assert main(["bench", "decode", "--model", "random:tiny", "--lengths", "256", "--profile-prefill-at", "0.5",
                 "--device", "cpu"]) == 2
    assert "it needs --profile-prefill-steps N" in capsys.readouterr().err
    assert main(["bench", "decode", "--model", "random:tiny", "--lengths", "256", "--profile-prefill-steps", "-1",
                 "--device", "cpu"]) == 2
    assert "--profile-prefill-steps must be >= 0, got -1" in capsys.readouterr().err


def _fire_compile(name: str) -> None:
    """What Triton does around a compilation: its cache hook, then its post-compile hook (keyword arguments)."""
    from types import SimpleNamespace

    from triton import knobs

    info = SimpleNamespace(name=name)
    assert not knobs.runtime.jit_cache_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    knobs.runtime.jit_post_compile_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                        already_compiled=False)


def test_jit_watch_times_compilations_chains_earlier_hooks_and_restores_them():
    from triton import knobs

    from longreach.kernels.jit_watch import JitWatch

    seen = []
    before = lambda **kw: seen.append(("before", kw["fn"].name))  # noqa: E731
    after = lambda **kw: seen.append(("after", kw["fn"].name))  # noqa: E731
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    try:
        with JitWatch() as w:
            _fire_compile("_a_kernel")
            _fire_compile("_b_kernel")
            _fire_compile("_a_kernel")
            mark = len(w.events)
            _fire_compile("_c_kernel")
        assert [n for n, _ in w.events] == ["_a_kernel", "_b_kernel", "_a_kernel", "_c_kernel"]
        assert all(s >= 0 for _, s in w.events)
        assert w.since(0)["kernels"] == {"_a_kernel": 2, "_b_kernel": 1, "_c_kernel": 1}
        assert w.since(mark) == {"count": 1, "seconds": round(w.events[-1][1], 3), "kernels": {"_c_kernel": 1}}
        assert seen[:2] == [("before", "_a_kernel"), ("after", "_a_kernel")] and len(seen) == 8
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (before, after)  # restored
        # an earlier hook that vetoes a compile (returns True): no post hook follows, nothing is recorded
        knobs.runtime.jit_cache_hook = lambda **kw: True
        with JitWatch() as w:
            info = {"key": "k", "repr": "r", "compile": {}, "is_manual_warmup": False, "already_compiled": False}
            assert knobs.runtime.jit_cache_hook(fn=None, **info) is True
        assert w.events == [] and w._stack == []
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_compilations_inside_timed_steps_are_reported_and_decode_ones_left_out_of_the_rate(tmp_path, capsys,
                                                                                          monkeypatch):
    """A kernel that compiles inside the timed prefill is counted, timed and named in the row (prefill_jit) and a
    note says the prefill time includes it; a decode step in which one compiles is a warm-up step (decode_jit)."""
    from longreach.tools.bench.decode import run
    from longreach.engine.llm_engine import LLMEngine
    from longreach.tools.eval.common import RunSpec

    step, calls = LLMEngine.step, []

    def step_compiling(self):
        calls.append(1)
        if len(calls) in (2, 7):  # the second prefill step and the fourth decode step (4 prefill steps of 128)
            _fire_compile(f"_step{len(calls)}_kernel")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", step_compiling)
    report = run("random:tiny", [512], [RunSpec("streaming", None, "streaming")],
                 {"device": "cpu", "kv_cache_memory_gb": 0.01, "max_num_batched_tokens": 128}, decode_tokens=8,
                 dense_lengths=[], out_path=str(tmp_path / "bd.json"), warmup_tokens=0)
    row = report["runs"][0]
    assert "error" not in row, row
    assert row["prefill_jit"]["count"] == 1 and row["prefill_jit"]["kernels"] == {"_step2_kernel": 1}
    assert row["decode_jit"]["kernels"] == {"_step7_kernel": 1}
    assert 2 in row["warmup_step_indices"]  # decode step index 2 (the 7th engine step; the prefill samples token 0)
    err = capsys.readouterr().err
    assert "1 Triton kernel compilation(s) inside the timed prefill" in err and "_step2_kernel x1" in err
    saved = json.loads((tmp_path / "bd.json").read_text())["runs"][0]
    assert saved["prefill_jit"]["count"] == 1


def test_a_preemption_inside_the_decode_steps_is_flagged(tmp_path, capsys):
    """Two 384-token prompts fit the KV cache, their 40 decode tokens each do not: one is preempted and recomputed
    between decode steps, and the summary says the rate is no steady batch figure."""
    from longreach.tools.bench.decode import run
    from longreach.tools.bench.decode_memory import _kv_bytes_per_token
    from longreach.tools.eval.common import parse_methods

    page = 16 * _kv_bytes_per_token(SHAPES["tiny"].config, "auto", torch.float32)
    engine = {"device": "cpu", "dtype": "float32", "attention_config": SMALL, "kv_cache_memory_gb": 50 * page / 2**30}
    r = run("random:tiny", [384], parse_methods(["dense"]), engine, batch=2, decode_tokens=40, dense_lengths=[],
            out_path=str(tmp_path / "b.json"))
    x = r["runs"][0]
    assert "error" not in x, x
    assert x["preemptions"] >= 1
    printed = capsys.readouterr()
    assert f"WARNING: {x['preemptions']} preemption(s)" in printed.out + printed.err


def test_a_kv_tier_too_small_for_the_batch_is_said_before_the_run(capsys):
    from longreach.tools.bench.decode import _warn_short_kv

    _warn_short_kv({"kv_cache_memory_gb": 72, "tensor_parallel_size": 2}, 150.0, 8, 131072, 16, 64)
    assert "--kv-cache-memory-gb 72 GiB is less than 16 x (131,072 + 64) tokens need (75.0 GiB per rank)" in \
        capsys.readouterr().err
    _warn_short_kv({"kv_cache_memory_gb": 40, "kv_offloading_size": 150}, 148.0, 8, 131072, 16, 64)
    _warn_short_kv({"kv_cache_memory_gb": 80, "tensor_parallel_size": 2}, 150.0, 8, 131072, 16, 64)
    assert "WARNING" not in capsys.readouterr().err  # the host tier holds it; each rank holds its half


def test_the_warm_up_captures_the_engines_graphs_before_the_timed_run(tmp_path, monkeypatch):
    """bench decode warms up as the server does: after its untimed prompt, `LLMEngine.capture_warm_graphs` (every
    context bucket's prefill-selection graphs and the long decode variants), so that their kernels compile outside
    the timed prefill."""
    from longreach.engine.llm_engine import LLMEngine
    from longreach.tools.bench.decode import run
    from longreach.tools.eval.common import parse_methods

    calls = []
    monkeypatch.setattr(LLMEngine, "capture_warm_graphs", lambda self: calls.append(self.config.max_model_len))
    run("random:tiny", [256], parse_methods(["infinitehip"]), {"device": "cpu", "dtype": "float32",
                                                               "attention_config": SMALL},
        decode_tokens=4, dense_lengths=[], out_path=str(tmp_path / "b.json"))
    assert calls == [260]
    run("random:tiny", [256], parse_methods(["infinitehip"]), {"device": "cpu", "dtype": "float32",
                                                               "attention_config": SMALL},
        decode_tokens=4, dense_lengths=[], out_path=str(tmp_path / "b.json"), warmup_tokens=0)
    assert calls == [260]  # no warm-up asked: nothing captured either


@pytest.mark.skipif("kv_offloading_size" not in EngineConfig.field_names(), reason="needs the KV offload store")
def test_a_batch_is_timed_decoding_together_after_every_prompt_is_prefilled(tmp_path):
    """An offloaded batch alternates prefill steps with decode steps of the prompts already done: those steps (fewer
    rows than the batch) are left out as `prefill_pending`, the first requests decode catch-up tokens meanwhile, and
    the rate counts `decode_tokens - 1` steps of every row after the last prompt is prefilled. Mixed steps (no
    offload) carry the early decodes inside prefill steps: the same count, all rows."""
    from longreach.tools.bench.decode import run
    from longreach.tools.bench.decode_steps import catch_up_tokens
    from longreach.tools.eval.common import parse_methods

    assert catch_up_tokens(1, 384, {}) == 0 and catch_up_tokens(3, 384, {"max_num_batched_tokens": 128}) == 3 * 12
    # paced chunks may fall to the pacer's 256 tokens: 16 x 128K at a 65,536-token budget may take 16 x 512 steps
    assert catch_up_tokens(16, 131072, {"max_num_batched_tokens": 65536}) == 16 * 8
    assert catch_up_tokens(16, 131072, {"max_num_batched_tokens": 65536, "mixed_step_target_ms": 40}) == 16 * 512
    base = {"device": "cpu", "dtype": "float32", "attention_config": SMALL, "max_num_batched_tokens": 128}
    for extra, interleaved in (({}, False), ({"kv_offloading_size": 0.01, "kv_cache_memory_gb": 0.0005}, True)):
        r = run("random:tiny", [384], parse_methods(["infinitehip"]), {**base, **extra}, batch=3, decode_tokens=6,
                dense_lengths=[], out_path=str(tmp_path / "b.json"))
        x = r["runs"][0]
        assert "error" not in x, x
        pending = x["steps_excluded"].get("prefill_pending", [])
        assert bool(pending) == interleaved, x["steps_excluded"]
        assert x["decode_steps"] - len(pending) == 5  # decode_tokens - 1 steps after the last prompt's prefill
        assert x["counted_rows_min"] == 3 and x["preemptions"] == 0
        assert x["steps_counted"] == 5 - sum(i not in pending for i in x["steps_excluded"].get("first_eager", []))
        if interleaved:  # the counters of the counted steps are their own (the prefill steps between are not in them)
            assert x["offload_stats"]["prefill"]["bytes_h2d"] >= 0 and x["offload_stats"]["decode"]
            bad = run("random:tiny", [384], parse_methods(["infinitehip"]), {**base, **extra}, batch=3,
                      decode_tokens=6, dense_lengths=[], out_path=str(tmp_path / "c.json"), profile_prefill_steps=1,
                      warmup_tokens=0)["runs"][0]
            assert "profile the prefill with --batch 1" in bad["error"]  # the row says why, the others go on


def test_gc_watch_records_collections():
    """engine/heap.py's `GcWatch`: each collection between start and stop as (generation, seconds); none after."""
    import gc

    from longreach.engine.heap import GcWatch

    w = GcWatch().start()
    gc.collect()
    gc.collect(1)
    w.stop()
    gc.collect()
    assert [g for g, _ in w.events][-2:] == [2, 1] and all(t >= 0 for _, t in w.events)
    assert w._callback not in gc.callbacks


def test_gc_pauses_keep_the_collections_of_at_least_a_millisecond_by_step():
    """engine/heap.py's `pauses` (bench decode's and bench mixed's `gc_pauses`): (step, generation, ms) of each
    collection of >= 1 ms, numbered by the step it ran in."""
    from longreach.engine.heap import pauses

    assert pauses([[(0, 0.0005)], [], [(2, 0.0031), (0, 0.001)]]) == [(2, 2, 3.1), (2, 0, 1.0)]
    assert pauses([]) == []
