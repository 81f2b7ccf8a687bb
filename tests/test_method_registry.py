"""Adding a method is its own code plus one registry call (issue 29): methods defined here, outside the package, run
through the engine like the built-in ones."""
from dataclasses import dataclass

import pytest
import torch

from longreach.attention import registry
from longreach.attention.backend import AttentionBackend, Capabilities, GraphSupport
from longreach.attention.dense import DenseFallback
from longreach.attention.sparse import SelectionMethod, SparseBackend, SparseConfig
from longreach.config import EngineConfig
from longreach.engine.llm import LLM
from longreach.engine.llm_engine import LLMEngine
from longreach.sampling_params import SamplingParams


class EveryLayerDense(AttentionBackend):
    """A method with no rule of its own: the toolkit's dense fallback in every layer."""

    name = "every-layer-dense"
    capabilities = Capabilities(graph=GraphSupport.STATIC)

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.fallback = DenseFallback(model_config, engine_config, device, tuple(range(model_config.num_layers)))
        self.layers_run = 0

    def forward(self, layer, q, k, v, k_cache, v_cache, meta):
        assert self.fallback.applies(layer, meta.max_seq_len)
        self.layers_run += 1
        return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)


@dataclass(frozen=True)
class EveryBlockConfig(SparseConfig):
    dense_below: int | None = 0  # select from the first token on: the toolkit's path, not its dense fallback


class EveryBlock(SelectionMethod):
    """A selection method that keeps every key block before the window (so attention reads every key)."""

    name = "every-block"
    config_cls = EveryBlockConfig
    presets = {"all": EveryBlockConfig(n_sink=4, n_window=8, block_q=16)}
    default_preset = "all"
    block_k = 4

    def selected_budget(self, layer: int) -> int:
        return 1 << 20

    def _select(self, layer, q, blocks, keys, state, step):
        W = -(-blocks.max_end // self.block_k)
        ids = torch.arange(W, device=q.device)
        ids = torch.where(ids[None, :] * self.block_k < self.candidate_end(blocks.ends)[:, None], ids, -1)
        return ids[:, None, :].expand(blocks.num_blocks, self.groups, W).to(torch.int32)


class EveryBlockBackend(SparseBackend):
    """Every key block, through the shared sparse backend (selection, packing, block-sparse attention)."""

    name = "every-block"
    method_cls = EveryBlock


@pytest.fixture
def own_registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_a_method_registered_from_outside_generates_as_dense_on_smollm2(smollm2, own_registry):
    registry.register_backend("every-layer-dense", EveryLayerDense)  # the one line a new method adds

    assert "every-layer-dense" in registry.available_backends()
    prompts = ["The history of the Roman Empire", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    dense = LLM.__new__(LLM)  # the session's dense engine
    dense.engine, dense.config = smollm2, smollm2.config
    want = [o.token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    mine = LLM.__new__(LLM)
    mine.engine = LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32", max_model_len=2048,
                                         kv_cache_memory_gb=0.5, attention="every-layer-dense"))
    mine.config = mine.engine.config
    assert isinstance(mine.engine.backend, EveryLayerDense)
    assert [o.token_ids for o in mine.generate(prompts, params, use_tqdm=False)] == want
    assert mine.engine.backend.layers_run > 0


def test_a_selection_method_on_the_sparse_toolkit_attends_as_dense(tmp_path, own_registry):
    """A SelectionMethod that keeps every block, on SparseBackend: the toolkit's path (query blocks, packing, the
    block-sparse executor, decode state) reads every key, so it gives dense attention's logits and tokens."""
    from conftest import make_tiny_hf_model

    registry.register_backend("every-block", EveryBlockBackend)
    path = make_tiny_hf_model(tmp_path / "m", max_position_embeddings=512)[0]
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64)
    ids = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = {}
    for name in ("dense", "every-block"):
        llm = LLM(path, attention=name, **kw)
        out[name] = (llm.engine.prompt_logits(ids),
                     llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].token_ids)
    assert isinstance(llm.engine.backend, EveryBlockBackend)
    torch.testing.assert_close(out["every-block"][0], out["dense"][0], atol=1e-4, rtol=1e-4)
    assert out["every-block"][1] == out["dense"][1]
