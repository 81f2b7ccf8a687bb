"""--rope-scaling (vLLM's flag): a checkpoint's RoPE scaling replaced at load, as if its config.json had it."""
import pytest
import torch


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0},
                                     {"type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0}])
def test_rope_scaling_flag_equals_the_same_scaling_in_config_json(tmp_path, scaling):
    import json
    import os

    from conftest import make_tiny_hf_model

    from longreach.engine.llm import LLM

    plain = make_tiny_hf_model(tmp_path / "plain", max_position_embeddings=64)[0]
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in os.listdir(plain):
        (scaled / f).write_bytes((tmp_path / "plain" / f).read_bytes())
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_scaling"] = {**scaling, "original_max_position_embeddings": 64}
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    (scaled / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256)
    ref = LLM(str(scaled), **kw)
    ours = LLM(plain, rope_scaling=json.dumps(scaling), **kw)
    assert ours.engine.model_config.rope == ref.engine.model_config.rope
    assert torch.equal(ours.engine.prompt_logits(ids), ref.engine.prompt_logits(ids))
    default = LLM(plain, **kw).engine.prompt_logits(ids)
    assert (default[100:] - ref.engine.prompt_logits(ids)[100:]).abs().max() > 1e-3  # the flag changed something


def test_rope_scaling_flag_rejects_bad_input(tmp_path):
    from conftest import make_tiny_hf_model

    from longreach.config import EngineConfig
    from longreach.engine.llm import LLM

    path = make_tiny_hf_model(tmp_path / "m", max_position_embeddings=64)[0]
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="rope_scaling must be a JSON object"):
        EngineConfig(rope_scaling="yarn")
    with pytest.raises(ValueError, match="rope_scaling must be a non-empty JSON object"):
        EngineConfig(rope_scaling="[]")
    with pytest.raises(ValueError, match=r"unknown rope_scaling key\(s\) \['fatcor'\]; valid: .*factor"):
        LLM(path, rope_scaling='{"rope_type": "yarn", "fatcor": 4}', **kw)
    with pytest.raises(ValueError, match="rope_scaling needs a rope_type"):
        LLM(path, rope_scaling='{"factor": 4}', **kw)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'ntk'; supported: default, linear"):
        LLM(path, rope_scaling='{"rope_type": "ntk", "factor": 4}', **kw)
