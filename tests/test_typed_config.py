"""Typed config at the boundary: `attention_config` is a dict inside (JSON text still accepted, parsed once, in
EngineConfig or the CLI), and `MethodSpec` is the one parser of `METHOD[:PRESET]`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from longreach.attention.registry import MethodSpec, available_backends
from longreach.config import EngineConfig, config_dict

STREAMING = {"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _generate(path, **kw) -> tuple[list[int], object]:
    """(the greedy tokens after a 160-token prompt, the decode backend's config)."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, **kw)
    ids = list(range(3, 163))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids, llm.engine.backend.config


def test_llm_takes_a_dict_attention_config_and_gives_what_its_json_text_gives(tiny):
    as_dict, cfg_dict = _generate(tiny, attention="streaming", attention_config=dict(STREAMING))
    as_text, cfg_text = _generate(tiny, attention="streaming", attention_config=json.dumps(STREAMING))
    assert as_dict == as_text and len(as_dict) == 8
    assert cfg_dict == cfg_text and (cfg_dict.n_sink, cfg_dict.n_window) == (8, 24)  # the overrides reached it
    composed = dict(attention="dense", decode_attention="streaming")
    d_dict, d_cfg_dict = _generate(tiny, decode_attention_config=dict(STREAMING), **composed)
    d_text, d_cfg_text = _generate(tiny, decode_attention_config=json.dumps(STREAMING), **composed)
    assert d_dict == d_text and d_cfg_dict == d_cfg_text and d_cfg_dict.n_window == 24


def test_engine_config_keeps_a_dict_of_its_own():
    text = EngineConfig(attention="streaming", attention_config=json.dumps(STREAMING))
    given = dict(STREAMING, dense_layers=[0])
    mine = EngineConfig(attention="streaming", attention_config=given)
    assert isinstance(text.attention_config, dict) and text.attention_config == STREAMING
    given["n_sink"] = 999
    given["dense_layers"].append(1)
    assert mine.attention_config == dict(STREAMING, dense_layers=[0])  # a copy: the caller's later edits stay out
    assert text == EngineConfig(attention="streaming", attention_config=dict(STREAMING))
    hash(mine)  # still hashable (the dicts are left out of the hash)
    from longreach.attention.streaming import StreamingBackend

    assert StreamingBackend.resolve_config(text) == StreamingBackend.resolve_config(mine.__class__(
        attention="streaming", attention_config=STREAMING))


@pytest.mark.parametrize("value, message", [
    ([1], r"attention_config must be a JSON object \(a dict, or its JSON text such as .*\), got list \[1\]"),
    ("[1]", r"attention_config must be a JSON object .*got str '\[1\]'"),
    ("{bad", r"attention_config must be a JSON object \(a dict, or its JSON text\), got '\{bad' \(Expecting"),
    (5, r"attention_config must be a JSON object .*got int 5"),
    ('"text"', r"attention_config must be a JSON object .*got str '\"text\"'"),
])
def test_bad_attention_config_says_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(attention="hip", attention_config=value)
    with pytest.raises(ValueError, match=message.replace("attention_config", "decode_attention_config", 1)):
        EngineConfig(decode_attention="hip", decode_attention_config=value)


def test_bad_attention_config_fails_in_llm_before_the_model_loads():
    from longreach.engine.llm import LLM

    with pytest.raises(ValueError, match="attention_config must be a JSON object"):
        LLM("/no/such/model", attention="hip", attention_config=["budget", 512])
    with pytest.raises(ValueError, match=r"unknown HiPConfig field\(s\) \['budjet'\]"):
        LLM("/no/such/model", attention="hip", attention_config={"budjet": 512})


def test_dense_still_refuses_an_empty_config_and_config_dict_passes_none():
    with pytest.raises(ValueError, match="dense attention .* takes no --preset or --attention-config"):
        EngineConfig(attention_config={})
    with pytest.raises(ValueError, match="dense attention .* takes no --preset or --attention-config"):
        EngineConfig(attention_config="{}")
    assert config_dict(None) is None and config_dict('{"a": [1]}') == {"a": [1]}


@pytest.mark.parametrize("text, want", [
    ("dense", MethodSpec("dense", None)),
    ("infinitehip", MethodSpec("infinitehip", None)),
    ("infinitehip:3k-fast", MethodSpec("infinitehip", "3k-fast")),
    ("psa:0.9", MethodSpec("psa", "0.9")),
    ("streaming:", MethodSpec("streaming", None)),  # an empty preset is the default, as before
])
def test_method_spec_parses_method_and_preset(text, want):
    spec = MethodSpec.parse(text)
    assert spec == want and (spec.method, spec.preset) == tuple(want)
    assert str(spec) == text.rstrip(":")
    assert MethodSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text, message", [
    ("nope", r"unknown attention backend 'nope'; available: cascading, dense, hip, infinitehip"),
    ("nope:3k", r"unknown attention backend 'nope'; available: "),
    ("infinitehip:9k", r"unknown infinitehip preset '9k'; available: 3k, 5k, 3k-fast"),
    ("psa:0.5", r"unknown psa preset '0.5'; available: 0.9, 0.95, 0.98"),
    ("dense:3k", r"dense attention \(the default --attention\) takes no --preset"),
    ("", "attention method must be METHOD\\[:PRESET\\] with METHOD one of " + ", ".join(available_backends())),
    ("  ", r"attention method must be METHOD\[:PRESET\]"),
    (None, r"attention method must be METHOD\[:PRESET\] .*got None"),
])
def test_method_spec_errors_name_the_known_methods_and_presets(text, message):
    """config.parse_method: MethodSpec.parse (attention/registry.py) plus the preset check (which needs EngineConfig,
    above attention/)."""
    from longreach.config import parse_method

    with pytest.raises(ValueError, match=message):
        parse_method(text)


def test_method_spec_names_what_it_parses_and_leaves_the_preset_to_config():
    with pytest.raises(ValueError, match=r"decode_attention must be METHOD\[:PRESET\]"):
        EngineConfig(decode_attention="")
    assert MethodSpec.parse("infinitehip:9k") == ("infinitehip", "9k")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        MethodSpec.parse("nope")


def test_method_spec_without_a_preset_imports_no_torch():
    code = ("import sys; from longreach.attention.registry import MethodSpec; MethodSpec.parse('infinitehip'); "
            "MethodSpec.parse('psa:0.9'); import longreach.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_eval_configs_travel_as_dicts():
    from longreach.tools.eval.common import decode_kwargs, eval_config, method_config, parse_methods

    keyed = {"infinitehip": {"exact_below": 0}, "psa": {"epsilon": 0.9}}
    (a,) = parse_methods(["infinitehip+psa"], attention_config=keyed)
    assert method_config(a, keyed) == {"exact_below": 0}
    assert decode_kwargs(a, keyed)["decode_attention_config"] == {"epsilon": 0.9}
    assert eval_config(json.dumps(keyed)) == keyed and eval_config(keyed) is keyed
    with pytest.raises(ValueError, match="--attention-config must be a JSON object"):
        parse_methods(["psa"], attention_config="[1]")
    with pytest.raises(ValueError, match=r"psa: --attention-config entry 'psa' must be a JSON object, got 5"):
        parse_methods(["psa"], attention_config={"psa": 5})
