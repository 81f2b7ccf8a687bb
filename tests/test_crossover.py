"""Decode's own dense limit (`dense_below_decode`), its "auto" value read from a measured crossover file
(attention/sparse/crossover.py), and `longreach calibrate crossover`, which writes that file (tools/bench/crossover.py).
CPU only: the timing is a fake function here; the engine runs are a tiny random model."""
import json
import logging

import pytest
import torch

from longreach import SamplingParams
from longreach.attention.sparse import crossover

# test_sparse.py's small infinitehip config, without its dense_below
BASE = {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8],
        "early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1]}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("cross") / "m", arch="llama", max_position_embeddings=256)[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "crossover"


def _llm(path, eager=True, **fields):
    from longreach.engine.llm import LLM

    kw = {k: fields.pop(k) for k in ("decode_attention", "decode_attention_config") if k in fields}
    return LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention="infinitehip",
               attention_config={**BASE, **fields}, max_model_len=512, max_num_batched_tokens=64,
               enforce_eager=eager, **kw)


def _tokens(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0].token_ids


def test_decode_limit_is_its_own_and_prefill_keeps_dense_below(model):
    """dense_below 128 with dense_below_decode 16: a 120-token prompt prefills densely (dense_below's limit), then
    decodes sparsely from its first step: the tokens of prefilling with dense_below 128 and decoding with a
    dense_below 16 backend (--decode-attention), unlike dense_below 128 alone, which decodes densely to 128. With
    CUDA graphs (emulated) the decode variants follow the decode limit."""
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = ids[:120]
    split, same = _llm(model, dense_below=128, dense_below_decode=16), _llm(model, dense_below=128)
    b = split.engine.backend
    assert (b.dense_below(1), b.dense_below(1, True), b.shortest_dense_below()) == (128, 16, 16)
    assert (split.engine.prompt_logits(ids) - same.engine.prompt_logits(ids)).abs().max() < 1e-5  # prefill: 128
    composed = _llm(model, dense_below=128, decode_attention="infinitehip",
                    decode_attention_config={**BASE, "dense_below": 16})
    got = _tokens(split, prompt)
    assert got == _tokens(composed, prompt)
    assert got != _tokens(same, prompt)  # the decode limit tells the two apart
    assert _tokens(_llm(model, dense_below=128, dense_below_decode=128), prompt) == _tokens(same, prompt)
    graphs = _llm(model, eager=False, dense_below=128, dense_below_decode=16)
    graphs.engine.runner.capture_graphs(emulate=True)
    assert _tokens(graphs, prompt) == got
    assert {key[2] for _, key in graphs.engine.runner._graphs} == {(False,)}  # past 16 at every decode step
    trained = _llm(model, dense_below=0, dense_below_decode="trained").engine.backend
    assert (trained.dense_below(1), trained.dense_below(1, True)) == (0, 256)
    with pytest.raises(ValueError, match='dense_below_decode must be an integer >= 0, "trained", "auto"'):
        _llm(model, dense_below_decode="always")


def test_crossover_rule():
    L = [4, 8, 16, 32]
    assert crossover.crossover_length(L, [1, 1, 1, 1], [2, 0.5, 0.5, 0.5]) == 8
    assert crossover.crossover_length(L, [1, 1, 1, 1], [0.5, 2, 0.5, 0.5]) == 16  # must stay faster
    assert crossover.crossover_length(L, [1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]) == 4
    assert crossover.crossover_length(L, [1, 1, 1, 1], [0.5, 0.5, 0.5, 1]) is None  # a tie is not faster
    assert crossover.decode_limit({"crossover": None}, 256) == 256
    assert crossover.decode_limit({"crossover": 1024}, 256) == 256


def _calibrate(model, step_s, *extra):
    from longreach.cli import _parse_json_configs, build_parser
    from longreach.tools.bench import crossover as command

    argv = ["calibrate", "crossover", "--model", str(model), "--attention", "infinitehip", "--attention-config",
            json.dumps(BASE), "--dtype", "float32", "--allow-cpu", *extra]
    args = build_parser().parse_args(argv)
    args.argv = argv
    _parse_json_configs(args)
    return command.main(args, step_s=step_s)


def test_calibrate_crossover_writes_the_file_that_auto_reads(model, cache, capsys, caplog):
    """The command times dense and the method at each length (a fake timing here: the method faster from 128 on),
    writes the file with its provenance, and an engine with dense_below_decode "auto" and the same key decodes
    densely up to min(trained, 128), with the tokens of dense_below_decode 128. A missing file (another method
    config: another key) falls back to dense_below's limit and logs the command that measures it; a file whose key
    differs is ignored."""
    times = {"dense": {32: 1.0, 64: 1.0, 128: 1.0, 256: 1.0}, "method": {32: 2.0, 64: 1.5, 128: 0.9, 256: 0.5}}
    calls = []

    def step_s(length, side):
        calls.append((length, side))
        return times[side][length]

    assert _calibrate(model, step_s, "--lengths", "32", "64", "128", "256") == 0
    assert calls == [(n, s) for n in (32, 64, 128, 256) for s in ("dense", "method")]
    out = capsys.readouterr()
    assert "crossover: 128" in out.out and "decodes densely up to 128 tokens" in out.err
    (path,) = cache.iterdir()
    record = json.loads(path.read_text())
    assert record["format"] == crossover.FORMAT and record["crossover"] == 128 and record["trained"] == 256
    assert record["command"].startswith("longreach calibrate crossover") and "commit" in record
    assert record["device"] == "cpu" and record["method_step_s"] == [2.0, 1.5, 0.9, 0.5]
    assert record["key"]["method"] == "infinitehip" and record["key"]["num_layers"] > 0

    ids = torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(6)).tolist()
    with caplog.at_level(logging.INFO, logger="longreach"):
        auto = _llm(model, dense_below=0, dense_below_decode="auto")
    assert auto.engine.backend.dense_below(1, True) == 128 and "crossover 128" in caplog.text
    assert _tokens(auto, ids) == _tokens(_llm(model, dense_below=0, dense_below_decode=128), ids)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="longreach"):  # another config: another key, no file
        other = _llm(model, dense_below=0, dense_below_decode="auto", n_window=24).engine.backend
    assert other.dense_below(1, True) == 0 and "longreach calibrate crossover" in caplog.text
    record["key"]["device"] = "NVIDIA H200"  # the file of this key, but written for another GPU
    path.write_text(json.dumps(record))
    assert _llm(model, dense_below=64, dense_below_decode="auto").engine.backend.dense_below(1, True) == 64


def test_calibrate_crossover_refuses_a_cpu_and_past_the_trained_context(model, cache):
    from longreach.cli import main

    with pytest.raises(ValueError, match="past the model's trained context"):
        _calibrate(model, lambda n, side: 1.0, "--lengths", "512")
    assert not cache.exists()
    assert main(["calibrate", "crossover", "--model", str(model), "--attention", "infinitehip",
                 "--device", "cpu"]) == 2
