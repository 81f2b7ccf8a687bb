"""The GPU benchmarks' own logic, run end to end on CPU at toy sizes (kernels in Triton's interpreter, host timers).

Timings here mean nothing; the test guards the code paths (index building, graph-step closures, amortisation,
FlexAttention mask assembly, the JSON and the table) so that a GPU session does not find them broken.
"""
import json

import torch

import longreach.tools.bench.attention as A


def test_bench_attention_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(A, "DEVICE", "cpu")
    monkeypatch.setattr(A, "DTYPE", torch.float32)
    monkeypatch.setattr(A, "HQ", 4)
    monkeypatch.setattr(A, "HKV", 2)
    monkeypatch.setattr(A, "D", 16)
    monkeypatch.setattr(A, "CHUNK", 128)
    monkeypatch.setattr(A, "CONFIG_OVERRIDES", {
        "infinitehip": dict(n_sink=16, n_window=32, chunk_sizes=(32, 8, 2), budgets=(256, 64, 16),
                            early_last_budget=None),
        "hip": dict(n_sink=16, n_window=32, budget=16, block_q=32),
        "minference": dict(block=32, last_q=32)})
    monkeypatch.setattr(A, "MINFERENCE_METHODS", (  # the mix covers the three patterns, kv-group the GQA variant
        ("minference vs kv-group", ("vertical_slash", 8, 40), "kv_head"), ("minference mix", None, None)))
    patterns = tmp_path / "p.json"
    patterns.write_text(json.dumps({"format": "longreach-minference-patterns/1", "granularity": "head", "block": 32,
                                    "layers": [{"choice": [["a_shape", 32, 96], ["vertical_slash", 8, 40],
                                                           ["block_sparse", 3], ["vertical_slash", 4, 60]]}]}))
    out = tmp_path / "bench.json"
    report = A.run([512], repeats=1, out_path=str(out), flex=True, decode_repeats=1,
                   minference_patterns=str(patterns))
    saved = json.loads(out.read_text())
    entry = saved["contexts"]["512"]
    assert {"dense cuDNN", "infinitehip 3k", "infinitehip 3k kv-rep", "infinitehip 5k", "hip 2k",
            "flex (ih 3k mask)", "minference vs kv-group", "minference mix"} <= set(entry["prefill"])
    assert entry["prefill"]["minference mix"]["mix"] == {"a_shape": 1, "block_sparse": 1, "vertical_slash": 2}
    errors = {k: v["error"] for phase in ("prefill", "decode") for k, v in entry[phase].items() if "error" in v}
    assert not errors, errors
    assert {"infinitehip 3k-fast amortised", "infinitehip kv-rep 3k-flash amortised", "hip 2k"} <= set(entry["decode"])
    assert "context 512 tokens" in A.format_table(report)
    # what is not timed as a run of its own says so: the amortised steps are derived, the key counts estimated
    amortised = entry["decode"]["infinitehip 3k-fast amortised"]
    assert "not timed" in amortised["derived"] and "derived" not in entry["decode"]["hip 2k"]
    assert entry["prefill"]["infinitehip 3k"]["estimated"] == ["keys_per_query_approx"]
    assert "not timed" in A.format_table(report)
    prov = saved["provenance"]  # tools/report.py's record
    assert prov["device"] == "cpu" and prov["samples"]["n"] == 1
    assert [(a["label"], a["preset"]) for a in prov["attention"]][:2] == [("infinitehip 3k", "3k"),
                                                                       ("infinitehip 3k kv-rep", "3k")]


def test_bench_serve_report_counts_the_gaps_a_long_prefill_causes():
    """The stall statistics see exactly the gaps that overlap a long prompt's prefill window, and the gauges parse."""
    from longreach.tools.bench.serve import RequestResult
    from longreach.tools.bench.serve_report import parse_gauges, report

    long = RequestResult("long", 1000, 1, 1000, True, start=1.0, ttft=2.0, e2el=2.1, token_times=[3.0])
    a = RequestResult("short", 8, 4, 8, True, start=0.0, ttft=0.1, e2el=4.0, itl=[0.2, 1.5, 0.05],
                      token_times=[0.1, 0.3, 1.8, 1.85])  # gaps 0.2 (before the window), 1.5 and 0.05 (inside)
    b = RequestResult("short", 8, 3, 8, True, start=3.5, ttft=0.1, e2el=0.5, itl=[0.3, 0.1],
                      token_times=[3.6, 3.9, 4.0])  # after the window: none count
    failed = RequestResult("short", 8, error="HTTP 503: overloaded")
    rep = report([a, long, b, failed], 5.0, {"endpoint": "/v1/completions", "num_prompts": 4})
    st = rep["stalls_during_long_prefill"]
    assert rep["long_prefill_windows_s"] == [(1.0, 3.0)]
    assert st["gaps"] == 2 and st["over_100ms"] == 1 and abs(st["max"] - 1500) < 1e-6
    assert st["worst"]["request"] == 0 and abs(st["worst"]["gap_start_s"] - 0.3) < 1e-9
    assert rep["groups"]["short"]["failed"] == 1 and rep["groups"]["short_during_long_prefill"]["completed"] == 1
    assert abs(rep["groups"]["short"]["itl_ms"]["max"] - 1500) < 1e-6
    assert "token_times" not in rep["requests"][0] and rep["errors"] == ["HTTP 503: overloaded"]
    text = ('# HELP x\nlongreach:num_requests_running{model_name="m"} 3.0\n'
            'longreach:process_resident_memory_bytes{model_name="m"} 1.5e+09\nother 7\n')
    assert parse_gauges(text) == {"running": 3.0, "rss_bytes": 1.5e9}


def test_bench_mixed_times_a_long_prefill_beside_decodes(tmp_path, monkeypatch):
    """`bench mixed` on the tiny random model: both methods run, the long prompt is prefilled in capped chunks beside
    the decodes (more steps than alone), and the profile covers the asked steps. Each engine's heap is frozen after
    its cold run, as the server's after its warm-up, and given back to the collector when the engine goes."""
    import gc

    from longreach.cli import main
    from longreach.engine import heap

    frozen = []
    freeze = heap.freeze_heap
    monkeypatch.setattr(heap, "freeze_heap", lambda: (freeze(), frozen.append(gc.get_freeze_count())))
    out = tmp_path / "mixed.json"
    assert main(["bench", "mixed", "--model", "random:tiny", "--device", "cpu", "--context", "2048", "--decodes", "3",
                 "--decode-prompt", "16", "--attention", "dense", "streaming", "--max-num-batched-tokens", "512",
                 "--profile-steps", "2", "--cprofile", "--prefill-graphs", "both", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["label"] for r in rep["runs"]] == ["dense", "streaming", "streaming/eager-selection"]
    assert [r["prefill_graphs"] for r in rep["runs"]] == [None, False, False]  # no CUDA graphs on a CPU
    for r in rep["runs"]:
        assert r["mixed_chunk_tokens_median"] == 128  # 512 / 4 while others run
        assert r["mixed_steps"] == len(r["step_ms"]) >= 2048 // 128
        assert r["standalone_prefill_s"] > 0 and r["mixed_prefill_s"] > 0 and r["decode_step_ms"] > 0
        assert r["profile"]["steps"] == 2 and r["host_profile"]
        assert all(0 <= step < r["mixed_steps"] and ms >= 1.0 for step, _, ms in r["gc_pauses"])
    assert len(frozen) == 3 and min(frozen) > 0 and gc.get_freeze_count() == 0
    assert rep["provenance"]["command"].startswith("longreach bench mixed")


def test_bench_mixed_profiles_deep_in_the_prompt_when_asked(tmp_path, capsys):
    """--profile-at 0.75: the profiled steps start once three quarters of the long prompt are prefilled (a sparse
    method's chunks there select over most of it), and the JSON says from which token."""
    from longreach.cli import main

    out = tmp_path / "mixed.json"
    assert main(["bench", "mixed", "--model", "random:tiny", "--device", "cpu", "--context", "2048", "--decodes", "2",
                 "--decode-prompt", "16", "--attention", "dense", "--max-num-batched-tokens", "512",
                 "--profile-steps", "2", "--profile-at", "0.75", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["runs"][0]
    assert r["profiled_from_token"] == 1536 and r["profile"]["steps"] == 2  # 128-token chunks: 12 steps in
    assert main(["bench", "mixed", "--model", "random:tiny", "--device", "cpu", "--profile-at", "1.5"]) != 0
    assert "--profile-at is a share of the long prompt in [0, 1), got 1.5" in capsys.readouterr().err
