"""Bad input gives a ValueError that says what was wrong and what is allowed; the CLI turns it into one line, exit 2."""
import os
import subprocess
import sys

import pytest

from longreach import SamplingParams
from longreach.config import EngineConfig
from longreach.engine.llm import LLM


@pytest.fixture(scope="module")
def llm(smollm2):
    out = LLM.__new__(LLM)
    out.engine, out.config = smollm2, smollm2.config
    return out


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(max_tokens=-3), "max_tokens must be a positive integer"),
    (dict(temperature=-0.1), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be a non-negative integer"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(stop=[""]), "stop must be non-empty strings"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention="nope"), r"unknown attention backend 'nope'; available: cascading, dense, hip, infinitehip, minference, psa, quest, streaming"),
    (dict(attention="hip", attention_config="{bad"), "attention_config must be a JSON object"),
    (dict(dtype="int8"), "dtype must be one of auto, bfloat16, float16, float32"),
    (dict(device="tpu"), "device must be one of auto, cpu, cuda"),
    (dict(block_size=3), "block_size must be a power of two"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(max_num_batched_tokens=4), "max_num_batched_tokens must be an integer >= 16"),
])
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_unknown_model_and_unknown_argument():
    with pytest.raises(ValueError, match=r"model 'no/such/model' not found: expected an alias \(smollm2\)"):
        LLM("no/such/model", device="cpu")
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM("smollm2", max_len=5)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["fine", {"prompt_token_ids": []}])
    too_long = {"prompt_token_ids": [5] * llm.config.max_model_len}
    with pytest.raises(ValueError, match=r"has 2048 tokens; max_model_len=2048 allows at most 2047"):
        llm.generate(too_long)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 99999]})
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate("x", [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llm.chat([])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        llm.chat([{"text": "hi"}])
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued after a rejected batch


def _cli(*args, stdin=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "longreach.cli", *args], capture_output=True, text=True,
                          input=stdin, env=env, timeout=600)


def test_help_is_complete():
    top = _cli("--help")
    assert top.returncode == 0 and "generate" in top.stdout and "backends" in top.stdout
    gen = _cli("generate", "--help")
    assert gen.returncode == 0
    for flag in ["--model", "--prompt", "--prompt-file", "--chat", "--system", "--max-tokens", "--temperature",
                 "--top-p", "--top-k", "--min-p", "--seed", "--stop", "--stop-token-ids", "--ignore-eos",
                 "--attention", "--max-model-len", "--max-num-batched-tokens", "--block-size", "--dtype", "--device",
                 "--enforce-eager", "--kv-cache-memory-gb", "--gpu-memory-utilization", "--preset",
                 "--attention-config", "--decode-attention", "--decode-attention-config"]:
        assert flag in gen.stdout, flag
    names = [line.split()[0] for line in _cli("backends").stdout.splitlines()[1:]]
    assert names == ["cascading", "dense", "hip", "infinitehip", "minference", "psa", "quest", "streaming"]
    for sub in (["eval", "recall"], ["eval", "agreement"], ["bench", "engine"], ["calibrate"]):
        r = _cli(*sub, "--help")
        assert r.returncode == 0 and "--model" in r.stdout, sub


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "hi", "--attention", "nope"], "unknown attention backend 'nope'; available: cascading, dense, hip, infinitehip"),
    (["--prompt", "hi", "--attention", "infinitehip", "--preset", "9k"], "unknown infinitehip preset '9k'; available"),
    (["--prompt", "hi", "--attention", "hip", "--attention-config", "[1]"], "attention_config must be a JSON object"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be a positive integer"),
    (["--prompt", "hi", "--model", "/no/such/model"], "model '/no/such/model' not found"),
    (["--prompt-file", "/no/such/file"], "cannot read --prompt-file"),
    (["--prompt", "hi " * 3000, "--device", "cpu", "--max-model-len", "100"], "max_model_len=100 allows at most 99"),
])
def test_cli_errors_are_one_line_with_exit_code_2(args, message):
    r = _cli("generate", *args)
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and message in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cli_generate_chat_prints_answer_and_timings():
    r = _cli("generate", "--chat", "--prompt-file", "-", "--max-tokens", "16", "--device", "cpu", "--no-progress",
             stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "prefill" in r.stderr and "tok/s" in r.stderr and "peak memory" in r.stderr


def test_import_is_cheap():
    code = "import sys, longreach; from longreach import SamplingParams; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


def test_demo_answers_and_reports(capsys):
    """The README's demo end to end at a short length on CPU (the sparse method runs dense below its budget here;
    the GPU runs in docs/quality.md are the long-context evidence)."""
    from longreach.cli import main

    assert main(["demo", "--length", "1024", "--no-dense", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "magic number" in out and "infinitehip on cpu" in out
    assert out.strip().splitlines()[-1].split()[-3] == "right"  # label, device, answer, verdict, seconds, "s"


def test_sigusr1_prints_the_python_stacks_and_the_run_goes_on(capfd):
    """scripts/device_runs.sh sends SIGUSR1 to a command that outlived its time: every thread's stack goes to stderr
    (where a stuck run was), and the process is not stopped by it."""
    import faulthandler
    import os
    import signal

    from longreach.cli import _stack_dumps_on_sigusr1

    if not hasattr(signal, "SIGUSR1"):
        pytest.skip("no SIGUSR1 on this platform")
    _stack_dumps_on_sigusr1()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        err = capfd.readouterr().err
    finally:
        faulthandler.unregister(signal.SIGUSR1)
    assert "test_sigusr1_prints_the_python_stacks" in err and "File" in err
