"""Shared fixtures. Triton kernels run in the interpreter on machines without a GPU (set before any kernel import)."""
import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # every kernel module imported now, under the interpreter: Triton decides at decoration time whether a @triton.jit
    # function is interpreted, and a test that sets TRITON_INTERPRET=0 (PyTorch references, tests/test_tensor_parallel)
    # would otherwise leave the modules it imports first as real JIT functions, which need a GPU driver in later tests
    # ("0 active drivers" when test_tensor_parallel.py ran before test_kernel_bsa.py)
    import importlib
    import pkgutil

    import longreach.kernels as _kernels

    for _m in pkgutil.iter_modules(_kernels.__path__):
        importlib.import_module(f"longreach.kernels.{_m.name}")

import torch  # noqa: E402

from longreach.config import EngineConfig  # noqa: E402
from longreach.engine.llm_engine import LLMEngine  # noqa: E402


def make_tiny_hf_model(path, arch: str = "llama", seed: int = 0, shard: bool = False, **overrides):
    """Save a small randomly initialised transformers checkpoint of `arch` in HF format; returns (path, hf_model)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cls, cfg_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
    elif arch == "mistral":
        cls, cfg_cls = transformers.MistralForCausalLM, transformers.MistralConfig
        common["sliding_window"] = None
    elif arch == "qwen2":
        cls, cfg_cls = transformers.Qwen2ForCausalLM, transformers.Qwen2Config
    elif arch == "qwen3":
        cls, cfg_cls = transformers.Qwen3ForCausalLM, transformers.Qwen3Config
        common["head_dim"] = 32  # Qwen3 decouples head_dim from hidden/heads
    else:
        raise ValueError(arch)
    common.update(overrides)
    model = cls(cfg_cls(**common)).float().eval()
    model.save_pretrained(str(path), max_shard_size="100KB" if shard else "5GB")
    return str(path), model


def add_word_tokenizer(path, vocab_size: int) -> None:
    """Give the checkpoint at `path` a tokenizer of one word per id ("<unk>", "<s>", "</s>", then "w3", "w4", ...;
    split on whitespace and punctuation, words joined by spaces when decoding: text and token ids map one to one)
    and a plain chat template ("role: content" lines, then "assistant:")."""
    import json

    import tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab_size)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(words[:3])
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, f)


def pid_gone(pid: int) -> bool:
    """Has process `pid` ended (and been reaped)? The tensor-parallel tests' check that no worker is left."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_with_joins(engine, prompts, params, joins: dict[int, int], max_steps: int) -> list[list[int]]:
    """Step `engine` directly, adding prompts[joins[step]] as request str(i) at each step listed in `joins` (so
    sequences join while others decode), until every joined request finished or `max_steps` ran. Returns the token
    ids of requests 0, 1, ... in order (a request that did not finish raises KeyError)."""
    out: dict[str, list[int]] = {}
    for step in range(max_steps):
        if step in joins:
            engine.add_request(str(joins[step]), prompts[joins[step]], params)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        if len(out) == len(joins):
            break
    return [out[str(i)] for i in range(len(joins))]


def pytest_addoption(parser):
    """Options of the GPU tests (tests/gpu/conftest.py reads them). pytest takes options only from the conftests it
    loads at start-up (this one, on any run from the repository root) or from plugins, so they are declared here."""
    group = parser.getgroup("gpu", "GPU tests (tests/gpu, marker gpu)")
    group.addoption("--gpu-model", default=os.environ.get("LONGREACH_GPU_MODEL"), metavar="PATH",
                    help="the model of the engine tests (default $LONGREACH_GPU_MODEL; without one they skip)")
    group.addoption("--gpu-report", default=None, metavar="PATH",
                    help="write the GPU tests' JSON report here (default $OUT/gpu_check.json where $OUT is set)")


@pytest.fixture(scope="module")
def one_thread():
    """Hundreds of tiny ops per step: on a shared 2-core machine two intra-op threads stall each other (~8 ms per
    einsum instead of 0.03). Results do not depend on it. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")` (the cascading tests)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, fp32 on CPU, loaded once per session."""
    return LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32", max_model_len=2048,
                                  kv_cache_memory_gb=0.5))


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from longreach.models.loader import resolve_model_path

    return resolve_model_path("smollm2")


def greedy_vs_transformers(llm, hf, ids: list[int], n: int = 16) -> tuple[list[int], list[int]]:
    """(transformers' greedy continuation of `ids`, `llm`'s with ignore_eos), `n` new tokens each (transformers' may
    stop early at an end-of-text token)."""
    from longreach import SamplingParams

    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    return want, got
