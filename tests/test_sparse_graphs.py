"""Sparse attention through the engine on its static-buffer (CUDA-graph) paths: graph decode and prefill-selection
graphs against eager runs, and the graphs and decode variants that the server's warm-up captures up front.

On a CPU the graph paths run emulated (the static buffers, each replay run eagerly); the tiny checkpoint is
tests/test_sparse.py's module fixture.
"""
import pytest
import test_sparse
import torch
from conftest import run_with_joins

tiny = test_sparse.tiny  # the module fixture: a tiny llama checkpoint, made once per module


GRAPH_CFG = {  # refresh intervals that leave some steps with no stage recomputed, and a dense_below limit (100)
    "infinitehip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8], '
                   '"early_layers": 1, "early_last_budget": 16, "refresh": [6, 3, 2], "dense_below": 100}',
    # stage 0 from kept boxes (attention/infinitehip/boxes.py): boxed inside the graph, a catch-up variant when the
    # 90-token prompt grows past dense_below
    "infinitehip-box": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], '
                       '"budgets": [64, 32, 8], "early_layers": 1, "early_last_budget": 16, "refresh": [6, 3, 2], '
                       '"dense_below": 100, "exact_below": 8, "stage0_scores": "minmax"}',
    # the last stage recomputed at every step, as in the default 3k-box's (8, 4, 1): never kept, never gathered
    "infinitehip-last1": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], '
                         '"budgets": [128, 32, 8], "early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], '
                         '"dense_below": 100}',
    "streaming": '{"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 100}',
    "hip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "budget": 16, "dense_layers": [0], "dense_below": 100, '
           '"refresh": 3}',
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("method", sorted(GRAPH_CFG))
def test_graph_decode_path_equals_eager_decode_with_staggered_sequences(tiny, method, device):
    """The static-buffer decode path that CUDA graphs capture (on CPU run eagerly: `capture_graphs(emulate=True)`;
    on a GPU really captured and replayed) gives every sequence the tokens of an eager run, while sequences join
    mid-way (so their refresh schedules are out of phase), one grows past dense_below (100) during decode, and the
    batch size changes."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 90, 120)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def make(eager):
        return LLM(tiny, device=device, dtype="float32", kv_cache_memory_gb=0.01, attention=method.split("-")[0],
                   attention_config=GRAPH_CFG[method], enforce_eager=eager)

    eager = make(True)
    expected = [eager.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].token_ids for p in prompts]
    llm = make(False)
    engine = llm.engine
    if device == "cpu":
        engine.runner.capture_graphs(emulate=True)
    assert engine.runner._graph_sizes
    assert run_with_joins(engine, prompts, params, {0: 0, 3: 1, 8: 2}, 80) == expected
    keys = {key for _, key in engine.runner._graphs}
    levels = {key[1] for key in keys}
    assert len(levels) >= 2 if method != "streaming" else levels == {0}, keys  # several refresh variants ran
    # the 90-token prompt decodes below dense_below beside longer ones: a variant where only a prefix of the rows
    # (longest first) runs the selection stages
    assert any(0 < key[3] < rows for rows, key in engine.runner._graphs), sorted(engine.runner._graphs)
    assert not engine.backend.graph.slots and not engine.backend.graph.cached  # finished sequences gave state back
    if method.endswith("-box"):
        assert any(key[4] for key in keys) and not engine.backend.boxes.rows  # a catch-up ran; boxes given back


@pytest.mark.parametrize("method", sorted(GRAPH_CFG))
def test_prefill_selection_graph_path_equals_eager(tiny, method):
    """The static-buffer path that captures a prefill chunk's selection (attention/sparse/prefill_graph.py; on a CPU
    run without capturing, `emulate`) gives the logits of the eager selection: the bucket-sized stage widths select
    the same blocks. Chunks of 256 rows go through it (a power of two >= MIN_ROWS), the last partial chunk eagerly."""
    from longreach.attention.sparse.prefill_graph import MIN_ROWS
    from longreach.engine.llm import LLM

    ids = torch.randint(3, 256, (1200,), generator=torch.Generator().manual_seed(7)).tolist()

    def make():
        return LLM(tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention=method.split("-")[0],
                   attention_config=GRAPH_CFG[method], max_num_batched_tokens=MIN_ROWS,
                   max_model_len=1280).engine

    expected = make().prompt_logits(ids)
    engine = make()
    graphs = engine.backend.prefill_graphs
    assert not graphs.enabled  # off on a CPU unless emulated
    graphs.enabled = graphs.emulate = True
    got = engine.prompt_logits(ids)
    assert graphs.replays > 0 and graphs.disabled_why is None
    assert (got - expected).abs().max() < 1e-5


def test_prefill_graphs_captured_up_front_cover_the_real_chunks(tiny):
    """`capture_prefill` (the server's warm-up) makes every key the prompt's full chunks then use: the real prefill
    adds none (on a CPU with the static-buffer path emulated), and the logits are those of the eager selection."""
    from longreach.attention.sparse.prefill_graph import MIN_ROWS
    from longreach.engine.llm import LLM

    ids = torch.randint(3, 256, (1200,), generator=torch.Generator().manual_seed(8)).tolist()

    def make():
        return LLM(tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention="infinitehip",
                   attention_config=GRAPH_CFG["infinitehip-box"], max_num_batched_tokens=MIN_ROWS,
                   max_model_len=1280).engine

    expected = make().prompt_logits(ids)
    engine = make()
    graphs = engine.backend.prefill_graphs
    graphs.enabled = graphs.emulate = True
    engine.prompt_logits(ids[:512])  # a forward first (as the server's warm-up request): buffers made in inference mode
    assert engine.runner.capture_prefill_graphs([MIN_ROWS, 100]) == 0  # emulated: nothing is captured for real
    keys = set(graphs._graphs)
    assert {k[4] for k in keys} == {256, 512, 1024, 1280}  # the buckets a 256-row chunk can end in, up to 1280
    got = engine.prompt_logits(ids)
    assert set(graphs._graphs) == keys and graphs.replays > len(keys)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("method", ["infinitehip-box", "hip"])
def test_warm_decode_variants_are_the_ones_a_long_sequence_uses(tiny, method):
    """`capture_warm_variants` (the server's warm-up) captures, for one and two long rows, every variant a long
    sequence's decode then uses, at the smallest batch size, at 16 rows and at 64, and the variants of short rows alone at
    every batch size: neither a batch of chats nor the long decode adds one (CPU, graphs emulated), and their tokens
    are the eager run's."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    prompt = torch.randint(3, 256, (1000,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def make(eager):
        return LLM(tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention=method.split("-")[0],
                   attention_config=GRAPH_CFG[method], enforce_eager=eager, max_model_len=1280)

    expected = make(True).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].token_ids
    llm = make(False)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    warm = runner.capture_warm_variants()
    keys = {key for _, key in runner._graphs}
    long = {k for k in keys if k[3] > 0}  # rows that select (k[3]: how many, a power of two)
    assert warm == len(runner._graphs) and {k[0] for k in long} == {128, 256, 512, 1024, 1280}
    # each at its smallest batch size, the smallest multiple of 16 (Triton's other specialisation) and 64 (16 x 4^k up
    # to the largest size, max_num_seqs 64 here)
    assert {n for n, k in runner._graphs if k in long} == {1, 2, 16, 64}
    assert {k for n, k in runner._graphs if n == 16} == keys
    # short rows alone (within dense_below 100: buckets 64 and 128), at every graph size: any batch of chats
    assert {k[0] for k in keys - long} == {64, 128} and all(k[2] == (True,) for k in keys - long)
    assert {n for n, k in runner._graphs if k not in long} == set(runner._graph_sizes)
    assert runner.capture_warm_variants() == 0  # nothing new the second time
    chats = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 90, 7)]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in make(True).generate([{"prompt_token_ids": c} for c in chats], short, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": c} for c in chats], short, use_tqdm=False)] == want
    assert {key for _, key in runner._graphs} == keys  # chats of up to 98 tokens found their variants warm
    replays, replay = [], runner._replay
    runner._replay = lambda batch: replays.append(1) or replay(batch)
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].token_ids
    assert got == expected and len(replays) == 23  # every decode step but the prefill's token went through a graph
    assert {key for _, key in runner._graphs} == keys  # the decode found every variant it needed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_long_row_among_many_chats_replays_a_larger_warm_graph(tiny, device):
    """A long prompt decoding beside 20 chats (21 rows: the 32-row bucket, whose long-row variants the warm-up does
    not capture) replays the warm 64-row graph of its variant, padded, and captures nothing inside a step (a server's
    1M prompt joining 63 chats captured three variants in one 516 ms step, docs/serving.md run 10); every request's
    tokens are the eager run's (CPU: graphs emulated; GPU: captured and replayed)."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    prompt = torch.randint(3, 256, (1000,), generator=torch.Generator().manual_seed(9)).tolist()
    chats = [torch.randint(3, 256, (20 + n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in [prompt, *chats]]

    def make(eager):
        return LLM(tiny, device=device, dtype="float32", kv_cache_memory_gb=0.02, attention="infinitehip",
                   attention_config=GRAPH_CFG["infinitehip-box"], enforce_eager=eager, max_model_len=1280)

    want = [o.token_ids for o in make(True).generate(reqs, params, use_tqdm=False)]
    llm = make(False)
    runner = llm.engine.runner
    if device == "cpu":
        runner.capture_graphs(emulate=True)
    runner.capture_warm_variants()
    warm = set(runner._graphs)
    assert [o.token_ids for o in llm.generate(reqs, params, use_tqdm=False)] == want
    assert set(runner._graphs) == warm and runner.padded_replays > 0
