"""`longreach eval ppl`: chunked per-token NLL in the engine, the window/PPL definition, the CLI end to end."""
import argparse
import json
import os

import pytest
import torch
from conftest import make_tiny_hf_model

from longreach import cli
from longreach.engine.llm import LLM
from longreach.tools.eval import ppl

STREAMING = '{"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0}'
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families. ") * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (trained context 256) with a byte-level tokenizer that opens every text with BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=257, max_position_embeddings=256)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))} | {"<s>": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>"}, f)
    return path


def _engine(path, **kw):
    return LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, **kw).engine


def test_prompt_nll_equals_log_softmax_of_whole_prompt_logits_across_chunks(tiny):
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = _engine(tiny).prompt_logits(ids)  # one chunk
    ref = -torch.log_softmax(whole[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    chunked = _engine(tiny, max_num_batched_tokens=64)  # chunks of 64, 64, 64, 8 tokens
    free = chunked.blocks.num_free_blocks
    nll = chunked.prompt_nll(ids)
    assert nll.shape == (199,) and nll.dtype == torch.float32
    assert (nll - ref).abs().max() < 1e-4
    assert (nll[[62, 63, 64, 127, 191, 198]] - ref[[62, 63, 64, 127, 191, 198]]).abs().max() < 1e-4  # chunk edges
    assert chunked.blocks.num_free_blocks == free  # the scoring sequence's pages went back
    with pytest.raises(ValueError, match="at least 2 tokens"):
        chunked.prompt_nll(ids[:1])


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("4k", 4096), ("8K", 8192), ("1M", 1 << 20), ("2", 2)])
def test_context_length_suffixes(text, tokens):
    assert ppl.context_length(text) == tokens
    assert ppl.format_length(tokens) == {"4096": "4K", "4k": "4K", "8K": "8K", "1M": "1M", "2": "2"}[text]


@pytest.mark.parametrize("text", ["4x", "1.5k", "k", "1", "-4k"])
def test_bad_context_length(text):
    with pytest.raises(argparse.ArgumentTypeError):
        ppl.context_length(text)


def test_windows_end_at_the_same_tokens_at_every_length():
    ids = list(range(1000))
    windows, layout = ppl.cut_windows(ids, [10, 100], 3, [])
    assert layout == {"ends": [100, 200, 300], "overlapping": False}  # the longest windows are disjoint
    assert windows[100][1] == ids[100:200] and windows[10][1] == ids[190:200]
    windows, layout = ppl.cut_windows(ids[:250], [10, 100], 3, [7])  # BOS + 99 text tokens; spread to the end
    assert layout == {"ends": [99, 174, 249], "overlapping": True}
    assert windows[100][2] == [7, *ids[150:249]] and windows[10][2] == [7, *ids[240:249]]
    with pytest.raises(ValueError, match="the text has 99 tokens, fewer than the context length 100"):
        ppl.cut_windows(ids[:99], [100], 1, [])
    with pytest.raises(ValueError, match="no room for 2 different windows of 100"):
        ppl.cut_windows(ids[:100], [100], 2, [])


def test_dense_ppl_of_smollm2_on_paul_graham_is_plausible(smollm2):
    from longreach.tools.eval.data import paul_graham_text

    ids = smollm2.tokenizer.encode(paul_graham_text()[:5000], add_special_tokens=False)
    row = ppl.score(smollm2, [ids[:512]], tail=256, label="dense")  # the tail: tokens 256..511, after 256 of context
    assert row["tokens_all"] == 511 and row["tokens_tail"] == 256
    assert 2 < row["ppl_all"] < 100 and 2 < row["ppl_tail"] < 100, row


def test_cli_end_to_end(tiny, tmp_path, capsys):
    text_file, out = tmp_path / "text.txt", tmp_path / "ppl.json"
    text_file.write_text(TEXT)
    rc = cli.main(["eval", "ppl", "--model", tiny, "--text-file", str(text_file), "--lengths", "64", "128", "512",
                   "--samples", "2", "--tail", "32", "--attention", "dense", "streaming",
                   "--attention-config", STREAMING, "--max-dense-length", "128", "--device", "cpu",
                   "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert {"model", "device", "dtype", "date", "args", "text", "lengths", "tail", "trained_context", "text_tokens",
            "bos", "windows", "methods"} <= set(report)
    assert report["lengths"] == [64, 128, 512] and report["trained_context"] == 256 and report["bos"] is True
    assert report["text_tokens"] == len(TEXT)  # one byte, one token
    assert report["windows"] == {"ends": [511, len(TEXT)], "overlapping": True}  # BOS + 511 text tokens at 512
    dense, streaming = report["methods"]["dense"], report["methods"]["streaming"]
    assert dense["512"] == {"skipped": "dense above --max-dense-length 128"}
    for n in (64, 128, 512):
        cell = streaming[str(n)]
        assert cell["tokens_all"] == 2 * (n - 1) and cell["tokens_tail"] == 2 * 32
        assert len(cell["ppl_tail_per_window"]) == 2
        assert cell["ppl_all"] > 1 and cell["ppl_tail"] > 1 and cell["seconds"] >= 0
        assert ("ratio_to_dense" in cell) == (n <= 128)
    assert streaming["64"]["ratio_to_dense"]["ppl_tail"] == pytest.approx(
        streaming["64"]["ppl_tail"] / dense["64"]["ppl_tail"])
    assert "ratio_to_dense" not in dense["64"]
    assert os.path.getsize(tmp_path / "ppl.png") > 0  # the plot goes next to --out by default
    assert "tail perplexity" in captured.err and "skipped" in captured.err


def test_cli_errors(tiny, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT[:100])
    base = ["eval", "ppl", "--model", tiny, "--text-file", str(text_file), "--device", "cpu", "--attention", "dense",
            "--tail", "32"]
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--lengths", "4x"])
    assert e.value.code == 2 and "expected a token count like 4096, 4k or 1M" in capsys.readouterr().err
    for extra, message in [
        (["--lengths", "128"], "the text has 100 tokens, fewer than the context length 128 (BOS + text)"),
        (["--lengths", "64", "--tail", "64"], r"--tail must be in [1, shortest length) = [1, 64), got 64"),
        (["--lengths", "64", "--samples", "0"], "--samples must be >= 1, got 0"),
        (["--lengths", "64", "--max-dense-length", "32"], "nothing to run: every length is above --max-dense-length"),
    ]:
        assert cli.main([*base, *extra]) == 2
        assert message in capsys.readouterr().err


def test_hotpotqa_text_is_long_deduplicated_natural_text():
    """The 1M-token perplexity source: titled Wikipedia paragraphs, each title once, at least the 8M-character cap."""
    from longreach.tools.eval.data import HOTPOTQA_CHARS, hotpotqa_text

    text = hotpotqa_text()
    paragraphs = text.split("\n\n")
    titles = [p.split("\n", 1)[0] for p in paragraphs]
    assert HOTPOTQA_CHARS <= len(text) < HOTPOTQA_CHARS + 20_000
    assert len(set(titles)) == len(titles) > 1000
    assert paragraphs[0].startswith("Ed Wood (film)\nEd Wood is a 1994 American")


def test_cli_quantization_fp8_reaches_the_engine(tiny, tmp_path, monkeypatch):
    """--quantization fp8 builds every method's engine with fp8 weights (the eval compares weight formats by running
    twice): the scores move, by little, and the provenance's command line records the flag."""
    from longreach.models import fp8

    quantized = []
    real = fp8.quantize_model_fp8
    monkeypatch.setattr(fp8, "quantize_model_fp8", lambda *a, **k: quantized.append(1) or real(*a, **k))
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    reports = {}
    for flag in ([], ["--quantization", "fp8"]):
        out = tmp_path / f"ppl{len(flag)}.json"
        assert cli.main(["eval", "ppl", "--model", tiny, "--text-file", str(text_file), "--lengths", "128",
                         "--tail", "32", "--attention", "dense", "--device", "cpu", "--plot", str(tmp_path / "p.png"),
                         "--out", str(out), *flag]) == 0
        reports[len(flag)] = json.loads(out.read_text())
    assert quantized == [1]  # only the second run quantised
    bf, q8 = (reports[n]["methods"]["dense"]["128"]["ppl_all"] for n in (0, 2))
    assert bf != q8 and q8 == pytest.approx(bf, rel=0.05)
    assert "--quantization fp8" in reports[2]["provenance"]["command"]
