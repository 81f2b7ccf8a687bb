"""MInference's shipped pattern files: name -> file resolution, the by-alias default, errors, and that each shipped
file fits its model's shape (read from the GGUF header when the model is here; no weights are loaded)."""
import json
import logging
import os
import sys

import pytest
import torch

from longreach.attention.minference import config as mf
from longreach.attention.minference import MInferenceBackend, MInferenceConfig, resolve_patterns, shipped_patterns
from longreach.config import EngineConfig
from longreach.models.config import ModelConfig

# (layers, query heads, KV heads) of the aliases with a shipped file; checked against the GGUF header where present
SHAPES = {"smollm2": (30, 9, 3), "qwen2.5-coder-0.5b": (24, 14, 2)}


def _model_config(layers: int, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=256, hidden_size=64 * heads, intermediate_size=128,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, rms_norm_eps=1e-5,
                       max_position_embeddings=8192)


@pytest.fixture
def fake_shipped(tmp_path, monkeypatch):
    """A patterns folder holding one file for the alias smollm2, shaped (2 layers, 4 heads)."""
    choice = [["a_shape", 64, 128], ["vertical_slash", 30, 100], ["block_sparse", 4], ["a_shape", 64, 128]]
    data = {"format": mf.PATTERNS_FORMAT, "granularity": "head", "block": 64,
            "layers": [{"choice": choice}, {"choice": choice}]}
    (tmp_path / "smollm2.json").write_text(json.dumps(data))
    monkeypatch.setattr(mf, "PATTERNS_DIR", str(tmp_path))
    return str(tmp_path / "smollm2.json")


def test_a_shipped_name_resolves_to_its_file_and_a_path_passes_through(fake_shipped):
    assert shipped_patterns() == {"smollm2": fake_shipped}
    assert resolve_patterns("smollm2") == fake_shipped
    assert MInferenceConfig(patterns="smollm2").patterns == fake_shipped
    assert resolve_patterns("P.json") == "P.json"  # a path, even one named like nothing shipped
    assert resolve_patterns("dir/smollm2") == "dir/smollm2"
    assert resolve_patterns(None) is None


def test_an_unknown_name_fails_listing_the_shipped_ones(fake_shipped):
    with pytest.raises(ValueError, match=r"unknown minference patterns 'qwen': give a shipped name \(smollm2\) or "
                                         r"the path of a \.json file"):
        MInferenceConfig(patterns="qwen")
    with pytest.raises(ValueError, match="unknown minference patterns 'llama'"):  # before any model loads
        EngineConfig(attention="minference", attention_config='{"patterns": "llama"}')


@pytest.mark.parametrize("model, preset, overrides, default", [
    ("smollm2", None, {}, True),  # run by its alias, nothing chosen: the shipped file
    ("smollm2", None, {"dense_below": 0}, True),  # fields that do not choose the pattern keep the default
    ("smollm2", "vs", {}, False),  # a preset is a choice
    ("smollm2", None, {"pattern": ["a_shape", 64, 128]}, False),
    ("smollm2", None, {"patterns": None}, False),  # the explicit "no file"
    ("smollm2", None, {"granularity": "kv_head"}, False),
    ("smollm2", None, {"block": 32}, False),
    ("qwen2.5-coder-1.5b", None, {}, False),  # an alias with no shipped file
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", None, {}, False),  # a path, even to the alias's file
])
def test_the_shipped_file_is_the_default_only_for_an_alias_with_the_choice_open(fake_shipped, model, preset,
                                                                                 overrides, default):
    ec = EngineConfig(model=model, attention="minference", preset=preset,
                      attention_config=json.dumps(overrides) if overrides else None)
    assert MInferenceBackend.resolve_config(ec, by_alias=True).patterns == (fake_shipped if default else None)
    assert MInferenceBackend.resolve_config(ec).patterns is None  # no model known: no default (EngineConfig, recall)


def test_the_backend_loads_and_logs_the_default_file(fake_shipped, caplog):
    with caplog.at_level(logging.INFO, logger="longreach"):
        b = MInferenceBackend(_model_config(2, 4, 2), EngineConfig(model="smollm2", attention="minference"),
                              torch.device("cpu"))
    assert b.method.layer_patterns(1)[2] == ("block_sparse", 4)
    assert f"({fake_shipped}, shipped for smollm2: the default for this alias" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="longreach"):
        b = MInferenceBackend(_model_config(2, 4, 2), EngineConfig(model="smollm2", attention="minference",
                                                                   preset="vs"), torch.device("cpu"))
    assert b.method.table is None and "no pattern file, every head vertical_slash" in caplog.text
    # the shipped file meets a model of another shape: the engine refuses before loading weights, saying why
    reasons = MInferenceBackend.unsupported_reasons(_model_config(3, 4, 2), EngineConfig(model="smollm2",
                                                                                         attention="minference"))
    assert reasons and "holds 2 layers; the model has 3" in reasons[0]


@pytest.mark.parametrize("alias", sorted(SHAPES))
def test_the_shipped_files_fit_their_models(alias):
    from longreach.models.gguf import GGUFFile
    from longreach.models.hub import ALIASES, locate

    assert alias in shipped_patterns(), f"no shipped patterns for {alias}: {sorted(shipped_patterns())}"
    layers, heads, kv_heads = SHAPES[alias]
    path = locate(ALIASES[alias])
    if path is not None:  # the model is here: its header (metadata only, memory-mapped) must agree
        mc = GGUFFile(path).model_config()
        assert (mc.num_layers, mc.num_heads, mc.num_kv_heads) == SHAPES[alias]
    mc = _model_config(layers, heads, kv_heads)
    assert not MInferenceBackend.unsupported_reasons(mc, EngineConfig(model=alias, attention="minference"))
    with open(shipped_patterns()[alias]) as f:
        data = json.load(f)
    prov = data["provenance"]
    assert prov["command"].startswith("longreach calibrate --method minference") and alias in prov["command"]
    assert prov["data"]["kind"] == "kv-retrieval"  # calibrated on synthetic data, never on the eval essays
    assert prov["model_sha256"] == ALIASES[alias].sha256


def test_the_shipped_files_are_package_data():
    """A non-editable install has them: every shipped file matches a package-data glob of pyproject.toml."""
    import fnmatch

    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["longreach.attention"]
    package = os.path.join(root, "longreach", "attention")
    for path in shipped_patterns().values():
        rel = os.path.relpath(path, package)
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data ({globs})"
