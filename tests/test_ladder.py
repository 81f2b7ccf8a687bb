"""The retrieval ladder's rungs (issue: where is the needle lost?): the oracle selection and positions-only presets,
which the lab registers (longreach/tools/eval/presets.py)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _eval_presets():
    from longreach.tools.eval.presets import register

    register()


def _keys_and_queries(seed, L=300, Hq=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, Hkv, D, generator=g), torch.randn(1, Hq, D, generator=g)


def test_oracle_picks_the_chunks_with_the_best_exact_keys():
    """One decode query: the oracle's chunks are exactly the brute-force top-k 8-token chunks by max over the group's
    heads of <q, k>, among the candidates [n_sink, end - n_window)."""
    from longreach.attention.infinitehip import InfiniteHiP
    from longreach.attention.presets import config_from

    m = InfiniteHiP.presets["oracle"]
    cfg = config_from(type(m), m, {"n_sink": 8, "n_window": 16, "budgets": [64], "early_last_budget": 64})
    method = InfiniteHiP(cfg, num_heads=4, num_kv_heads=2)
    keys, q = _keys_and_queries(0)
    L = keys.shape[0]
    got = method.select(5, q, [(0, 1, L - 1)], keys)[0]  # (G, W)
    end = L - 16
    for g in range(2):
        s = torch.einsum("hd,ld->hl", q[0, 2 * g:2 * g + 2], keys[:, g]).amax(0)  # the group's 2 heads
        chunk_best = torch.stack([s[max(8, c * 8):min(end, c * 8 + 8)].max() for c in range(1, -(-end // 8))])
        want = (torch.topk(chunk_best, 8).indices + 1).sort().values
        assert got[g][got[g] >= 0].tolist() == want.tolist()


def test_oracle_at_full_budget_and_true_positions_equals_dense(tmp_path):
    from conftest import make_tiny_hf_model

    from longreach.engine.llm import LLM

    path = make_tiny_hf_model(tmp_path / "m", max_position_embeddings=512)[0]
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64)
    dense = LLM(path, **kw).engine.prompt_logits(ids)
    full = LLM(path, attention="infinitehip", preset="oracle", attention_config='{"budgets": [512], '
               '"early_last_budget": 512, "n_sink": 8, "n_window": 16, "attend_rope": "none", "dense_below": 0}',
               **kw).engine.prompt_logits(ids)
    assert (dense - full).abs().max() < 1e-4
    every = LLM(path, attention="infinitehip", preset="positions-st", attention_config='{"n_sink": 8, '
                '"n_window": 16, "attend_rope": "none", "dense_below": 0}', **kw).engine.prompt_logits(ids)
    assert (dense - every).abs().max() < 1e-4
    small = LLM(path, attention="infinitehip", preset="oracle", attention_config='{"budgets": [16], '
                '"early_last_budget": 16, "n_sink": 8, "n_window": 16, "attend_rope": "none", "dense_below": 0}',
                **kw).engine.prompt_logits(ids)
    assert (dense[150:] - small[150:]).abs().max() > 1e-3  # a small budget really drops keys


@pytest.mark.parametrize("preset", ["positions-st", "positions-de"])
def test_positions_rungs_remap_past_the_trained_length(tmp_path, preset):
    """The positions-only rungs attend every key and remap positions past the trained context only: equal to dense
    inside it, different past it. (With dense_below at its default they were dense attention at every length below
    their 1M budget: the rung measured nothing.)"""
    from conftest import make_tiny_hf_model

    from longreach.engine.llm import LLM

    path = make_tiny_hf_model(tmp_path / "m", max_position_embeddings=64)[0]
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64, max_model_len=256)
    dense = LLM(path, **kw).engine.prompt_logits(ids)
    rung = LLM(path, attention="infinitehip", preset=preset, attention_config='{"n_sink": 8, "n_window": 16}',
               **kw).engine.prompt_logits(ids)
    assert (dense[:60] - rung[:60]).abs().max() < 1e-4  # inside the trained 64 tokens: exact attention
    assert (dense[100:] - rung[100:]).abs().max() > 1e-2  # past it: the positions are remapped


def test_exact_stages_select_what_the_oracle_selects():
    """`3k-exact` scores every stage exactly (max over the group's heads and rows of <q, k>): since a chunk's best key
    is at least each of its sub-chunks' best, nested exact stages whose budgets hold the oracle's chunks keep exactly
    the oracle's flat top-k (at equal positions: here inside the trained length, so true positions for both)."""
    from longreach.attention.infinitehip import InfiniteHiP
    from longreach.attention.presets import config_from

    base = {"n_sink": 8, "n_window": 64, "early_last_budget": 64}
    oracle = InfiniteHiP(config_from(InfiniteHiP.config_cls, InfiniteHiP.presets["oracle"], {**base, "budgets": [64]}),
                         num_heads=4, num_kv_heads=2)
    exact = InfiniteHiP(config_from(InfiniteHiP.config_cls, InfiniteHiP.presets["3k-exact"],
                                    {**base, "budgets": [512, 256, 64]}), num_heads=4, num_kv_heads=2)
    keys, _ = _keys_and_queries(3, L=2000)
    q = torch.randn(16, 4, 16, generator=torch.Generator().manual_seed(4))
    blocks = [(0, 1, 1999), (1, 15, 1975)]  # (first row, rows, position of the first row): a last row, a 15-row block
    for layer in (0, 5):
        want, got = oracle.select(layer, q, blocks, keys), exact.select(layer, q, blocks, keys)
        assert want.shape[-1] == 8 and bool((want >= 0).all())  # 64 tokens = 8 chunks per block and group
        assert torch.equal(want, got)


def test_box_preset_equals_exact_while_stage0_keeps_every_chunk():
    """`3k-box` differs from `3k-exact` only in how stage 0 scores (a min/max box per 64-token chunk vs every key).
    While stage 0's budget holds every candidate chunk (contexts up to 32K with the presets' budgets) neither scores
    it, so the two select the same keys: the ladder's 4K-32K cells of the two presets are one measurement. Once stage
    0 must choose, the box path runs and may choose differently."""
    from longreach.attention.infinitehip import InfiniteHiP
    from longreach.attention.presets import config_from

    def method(preset, budgets):
        cfg = config_from(InfiniteHiP.config_cls, InfiniteHiP.presets[preset],
                          {"n_sink": 8, "n_window": 64, "early_last_budget": 64, "budgets": budgets})
        return InfiniteHiP(cfg, num_heads=4, num_kv_heads=2)

    keys, _ = _keys_and_queries(3, L=2000)
    q = torch.randn(16, 4, 16, generator=torch.Generator().manual_seed(4))
    blocks = [(0, 1, 1999), (1, 15, 1975)]
    wide = [2048, 256, 64]  # stage 0 keeps all of its <= 31 candidate chunks
    box, exact = method("3k-box", wide), method("3k-exact", wide)
    assert not box.stage_widths(5, 2000)[0][1]  # stage 0 is not scored
    for layer in (0, 5):
        assert torch.equal(box.select(layer, q, blocks, keys), exact.select(layer, q, blocks, keys))
    narrow = [512, 256, 64]  # stage 0 keeps 8 of ~31 chunks: the box scores them
    box = method("3k-box", narrow)
    assert box.stage_widths(5, 2000)[0][1]
    calls = []
    real = box.box_scores
    box.box_scores = lambda *a, **k: calls.append(1) or real(*a, **k)
    got = box.select(5, q, blocks, keys)
    assert calls and got.shape[-1] == 8 and bool((got >= 0).all())


def test_ladder_tables_merge_reports_and_print_traces(tmp_path):
    """scripts/ladder_table.py on tiny reports: passkey cells of one label merged over two jobs' lengths, a RULER
    score with its interval, a RULER cell split over two jobs' seeds, and the needle traces of finished and cut-off trace jobs (a broken merge or a dropped
    partial file changes the text)."""
    import json
    import subprocess
    import sys

    def cells(length, right):
        return [{"length": length, "depth": 0.5, "seed": s, "correct": s < right} for s in range(4)]

    def write(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))

    write("passkey__paul-graham__m__4k.json", {"methods": {"m": {"cells": cells(4096, 4)}}})
    write("passkey__paul-graham__m__64k.json", {"methods": {"m": {"cells": cells(65536, 1)}}})
    write("ruler__niah_single_2__m__4k.json",
          {"methods": {"m": {"tasks": {"niah_single_2": {"4096": {"score": 50.0, "n": 20}}}}}})
    for seed, score in ((42, 100.0), (43, 50.0)):  # one 1M cell split over two jobs (a seed each): 3 of 4 right
        write(f"ruler__niah_single_1__m__1M-s{seed}.json",
              {"methods": {"m": {"tasks": {"niah_single_1": {"1048576": {"score": score, "n": 2}}}}}})
    write("ruler__niah_single_3__ih-variants__256k.json",  # decode variants in one report (--share-prefill): a row each
          {"methods": {"ih:3k": {"tasks": {"niah_single_3": {"262144": {"score": 70.0, "n": 10}}}},
                       "ih:3k@fresh": {"tasks": {"niah_single_3": {"262144": {"score": 100.0, "n": 10}}}}}})
    run = {"length": 524288, "depth": 0.5, "right": False, "layers": "00kK"}
    write("trace__paul-graham__oracle__524288.json", {"runs": [run]})
    write("trace__paul-graham__s0x2__524288.partial.json", {"runs": [dict(run, right=True, layers="0KKK")]})
    script = __import__("pathlib").Path(__file__).resolve().parents[1] / "scripts" / "ladder_table.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| m | 100 [51-100] | 25 [5-70] | 4 |" in out
    assert "| m | 50 [30-70] | 20 |" in out
    assert "| m | 75 [30-95] | 4 |" in out
    assert "| ih-3k | 70 [40-89] | 10 |" in out and "| ih-3k-fresh | 100 [72-100] | 10 |" in out
    assert "oracle      512K depth 0.5 wrong  00kK" in out
    assert "s0x2        512K depth 0.5 right  0KKK" in out
