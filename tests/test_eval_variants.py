"""Decode variants over one prefill (tools/eval/variants.py) and the engine's `keep_kv` / `redecode` / `release_kv`:
a prompt prefilled once and decoded under several decode-only configs gives each config's own engine's tokens."""
import pytest
import torch

from longreach import SamplingParams
from longreach.engine.llm import LLM
from longreach.tools.eval.common import RunSpec
from longreach.tools.eval.variants import DecodeVariants, check_variants, generate_variants

from conftest import make_tiny_hf_model

# small budgets that prune prompts of a few hundred tokens (tests/test_tensor_parallel.py's), so decode selects
BASE = {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [64, 16, 4],
        "early_layers": 1, "early_last_budget": 8, "dense_below": 0}
VARIANTS = [dict(BASE, refresh=[8, 8, 8]), dict(BASE, refresh=[1, 1, 1]), dict(BASE, refresh=[8, 8, 8], lookahead=1),
            dict(BASE, refresh=[8, 8, 8], ahead=True)]
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.02, cpu_threads=1, block_size=8,
              max_num_batched_tokens=64, max_num_seqs=3, attention="infinitehip")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("v") / "m", vocab_size=250, max_position_embeddings=1024)[0]


def _prompts(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (300, 170, 260)]


@pytest.mark.parametrize("graphs", [False, True])
def test_each_variant_decodes_as_its_own_engine(path, graphs, monkeypatch):
    """Per variant, the shared-prefill tokens equal those of an engine built with that config alone (eagerly, and on
    the emulated graph path, where each variant's graphs are its own); the variants do decode differently (so the
    check can fail), and every page comes back."""
    if graphs:
        monkeypatch.setenv("LONGREACH_EMULATE_GRAPHS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch references: faster here (test_sparse runs the kernels)
    prompts = _prompts()
    want = []
    for cfg in VARIANTS:
        llm = LLM(path, attention_config=cfg, **ENGINE)
        want.append([o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                       use_tqdm=False)])
    assert all(w != want[0] for w in want[1:])  # refresh, lookahead and ahead change this model's decode
    llm = LLM(path, attention_config=VARIANTS[0], **ENGINE)
    variants = DecodeVariants.install(llm.engine, VARIANTS)
    assert llm.engine.runner.backend is variants and llm.engine.scorer.backend is variants
    assert [b.config.refresh for b in variants.backends] == [(8, 8, 8), (1, 1, 1), (8, 8, 8), (8, 8, 8)]
    got, seconds = generate_variants(llm, prompts, GREEDY, variants)
    assert [[o.token_ids for o in outs] for outs in got] == want
    assert len(seconds) == 4 and all(s > 0 for s in seconds)
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    if graphs:  # each variant's decode steps replayed graphs keyed by its index
        assert {key[0] for _, key in llm.engine.runner._graphs} == {0, 1, 2, 3}


def test_groups_follow_the_free_pages(path, monkeypatch):
    """Prompts whose kept KV would not fit at once run in groups (each group through every variant): same tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prompts = _prompts(seed=6)
    llm = LLM(path, attention_config=VARIANTS[0], **dict(ENGINE, kv_cache_memory_gb=0.0004, max_model_len=400))
    blocks = llm.engine.blocks
    need = sum(blocks.blocks_for(len(p) + GREEDY.max_tokens) for p in prompts)
    assert blocks.num_blocks < need  # the three do not fit at once
    want = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    variants = DecodeVariants.install(llm.engine, VARIANTS[:2])
    got, _ = generate_variants(llm, prompts, GREEDY, variants)
    assert [o.token_ids for o in got[0]] == want
    assert blocks.num_free_blocks == blocks.num_blocks


def test_keep_kv_redecode_and_release(path):
    llm = LLM(path, attention_config=VARIANTS[1], **ENGINE)
    engine = llm.engine
    prompt = _prompts()[1]
    engine.add_request("r", prompt, GREEDY, keep_kv=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    first = outs[0].token_ids
    held = engine.blocks.num_blocks - engine.blocks.num_free_blocks
    assert held == engine.blocks.blocks_for(len(prompt) + GREEDY.max_tokens)  # the pages stay
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", prompt, GREEDY)
    assert engine.redecode("r") is None
    again = []
    while engine.has_unfinished_requests():
        again += engine.step()
    assert again[0].token_ids == first  # the same config again: the same tokens, no prefill step ran
    engine.release_kv("r")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    with pytest.raises(ValueError, match="not a finished request kept with keep_kv"):
        engine.redecode("r")
    # a sample that stops at its first token comes back at once
    engine.add_request("one", prompt, SamplingParams(temperature=0, max_tokens=1), keep_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.redecode("one")
    assert out is not None and len(out.token_ids) == 1 and out.token_ids[0] == first[0]
    engine.release_kv("one")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_keep_kv_is_refused_with_offloading(path):
    llm = LLM(path, attention_config=VARIANTS[0], **dict(ENGINE, kv_offloading_size=0.01))
    with pytest.raises(ValueError, match="pages all stay on the GPU; this engine has a KV cache that stages"):
        llm.engine.add_request("r", _prompts()[0], GREEDY, keep_kv=True)


@pytest.mark.parametrize("specs, configs, message", [
    ([RunSpec("infinitehip", "3k", "a"), RunSpec("infinitehip", "3k", "b")],
     [None, {"budgets": [65536, 16384, 4096]}], "b differs from a in budgets, which prefill reads"),
    ([RunSpec("infinitehip", "3k", "a"), RunSpec("infinitehip", "5k", "b")], [None, None], "one sparse method"),
    ([RunSpec("dense", None, "dense"), RunSpec("dense", None, "d2")], [None, None], "one sparse method"),
    ([RunSpec("infinitehip", "3k", "a"), RunSpec("infinitehip", "3k", "b", "psa")], [None, None], "composed"),
])
def test_check_variants_says_what_may_differ(specs, configs, message):
    with pytest.raises(ValueError, match=message):
        check_variants(specs, configs)
    ok = [RunSpec("infinitehip", "3k", "a"), RunSpec("infinitehip", "3k", "c")]
    check_variants(ok, [None, {"refresh": [1, 1, 1], "lookahead": 2, "dense_below_decode": 0}])


def test_ruler_refuses_runs_that_cannot_share(capsys):
    from longreach.cli import main

    rc = main(["eval", "ruler", "--device", "cpu", "--share-prefill", "--attention", "infinitehip:3k",
               "infinitehip:3k@big", "--attention-config", '{"infinitehip:3k@big": {"budgets": [65536, 16384, 4096]}}'])
    err = capsys.readouterr().err
    assert rc == 2 and "differs from infinitehip:3k in budgets" in err and "Traceback" not in err


def test_passkey_share_prefill_equals_separate_runs(monkeypatch, capsys):
    """`eval passkey --share-prefill` (SmolLM2, CPU): per variant, the answers of separate runs, prompt by prompt, and
    the report says the prefill was shared."""
    import json

    from longreach.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = json.dumps({"infinitehip@a": dict(BASE, refresh=[8, 8, 8], budgets=[256, 64, 16]),
                      "infinitehip@b": dict(BASE, refresh=[1, 1, 1], budgets=[256, 64, 16])})
    argv = ["eval", "passkey", "--lengths", "1k", "--depths", "0.3", "0.7", "--device", "cpu", "--cpu-threads", "1",
            "--kv-cache-memory-gb", "0.05", "--new-tokens", "6", "--attention-config", cfg, "--plot", ""]
    reports = []
    for extra in (["--attention", "infinitehip@a", "infinitehip@b"],
                  ["--attention", "infinitehip@a", "infinitehip@b", "--share-prefill"]):
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        reports.append(json.loads(out[out.index("{"):out.rindex("}") + 1]))
    separate, shared = reports
    assert shared.get("share_prefill") is True and "share_prefill" not in separate
    for label in ("infinitehip@a", "infinitehip@b"):
        want = [(c["key"], c["output"]) for c in separate["methods"][label]["cells"]]
        got = [(c["key"], c["output"]) for c in shared["methods"][label]["cells"]]
        assert got == want, label
