"""Tensor parallelism (issue 32), milestone 3: `longreach serve` over TP=2, and torchrun launching the ranks. CPU
processes over gloo, fp32, a tiny random checkpoint with a one-word-per-id tokenizer (conftest.add_word_tokenizer).

  * the server at TP=2 answers a chat with TP=1's greedy tokens and logprobs (scored through the plans), and its
    /health_generate and /metrics; SIGTERM ends it with status 0 and its worker with it;
  * a SIGKILLed worker while a stream runs: the stream ends with an `engine_dead` error naming the rank, the server
    exits 1, and no process it started is left;
  * a worker dying while the server idles: the engine loop notices within its wake-up interval, /health is 503 with
    the rank and its exit code (in-process: the subprocess drains and exits before a probe could see it reliably);
  * `python -m torch.distributed.run --nproc-per-node 2 -m longreach generate --tensor-parallel-size 2` prints TP=1's
    greedy text (the word tokenizer maps text to ids one to one); a WORLD_SIZE that is not the TP size is refused.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import httpx
import pytest

from longreach import SamplingParams
from longreach.engine.llm import LLM

from conftest import add_word_tokenizer, make_tiny_hf_model, pid_gone
from server_harness import RemoteServer, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, cpu_threads=1, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=3)  # tests/test_tensor_parallel.py's: chunked prefill
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-gb", "0.01", "--cpu-threads", "1",
               "--block-size", "8", "--max-num-batched-tokens", "16", "--max-num-seqs", "3"]
CHAT = [{"role": "user", "content": "w5 w9 w100 w17 w3 w250 w42"}]  # w250: past the vocabulary, <unk>


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """4 KV heads (2 per rank), a vocabulary of 250 (not a multiple of the ranks' rows), with a tokenizer."""
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tp") / "m", vocab_size=250, num_attention_heads=8,
                                 num_key_value_heads=4, hidden_size=128, max_position_embeddings=512)
    add_word_tokenizer(path, 250)
    return path


@pytest.fixture(scope="module")
def one(model):
    return LLM(model, **ENGINE)


def _children(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += list(kids - found)
            found |= kids
    return found


def _worker_pid(server: RemoteServer) -> int:
    found = re.search(r"workers pids \[(\d+)\]", server.log_text())
    assert found, server.log_text()
    return int(found.group(1))


def _server(model, *extra) -> RemoteServer:
    return RemoteServer([model, *ENGINE_ARGS, "--tensor-parallel-size", "2", *extra], startup_timeout=120)


def test_server_tp2_chat_equals_tp1_and_stops_its_worker(model, one):
    srv = _server(model, "--warmup-tokens", "40")  # the warm-up request runs through the plans as well
    try:
        worker = _worker_pid(srv)
        with srv.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0,
                                                     "ignore_eos": True, "return_token_ids": True, "logprobs": True})
            assert r.status_code == 200, r.text
            body = r.json()
            ids, got = body["prompt_token_ids"], body["choices"][0]["token_ids"]
            want = one.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10,
                                                                           ignore_eos=True), use_tqdm=False)[0]
            assert got == want.token_ids and len(got) == 10
            # the logprobs: rank 0 re-scores prompt + output between steps, the workers run the same chunks
            lp = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
            ref = one.engine.prompt_logprobs(ids + got, 0, start=len(ids))[0].tolist()
            assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4 and len(lp) == len(ref)
            assert c.get("/health_generate").status_code == 200
            metrics = c.get("/metrics").text.splitlines()
            done = [float(line.rsplit(" ", 1)[1]) for line in metrics if line.startswith("longreach:request_success_total{")]
            assert sum(done) == 2  # the chat and /health_generate's request
            assert c.get("/server_info").json()["engine_args"]["tensor_parallel_size"] == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        assert "workers ended (exit codes [0])" in srv.log_text()  # on the stop plan, not terminated
    finally:
        srv.stop()
    assert pid_gone(worker)


def test_server_tp2_killed_worker_fails_the_stream_and_exits_1_without_orphans(model):
    srv = _server(model)
    worker = _worker_pid(srv)
    started = _children(srv.proc.pid)
    assert worker in started
    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # streaming
            os.kill(worker, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "engine_dead" and "tensor-parallel rank 1" in err["message"], err
        assert srv.proc.wait(30) == 1, srv.log_text()
        assert "exiting with status 1" in srv.log_text()
    finally:
        srv.stop()
    assert wait_until(lambda: all(pid_gone(p) for p in started), timeout=10), [p for p in started if not pid_gone(p)]


def test_a_worker_dying_while_the_server_idles_makes_health_503(model):
    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.server.app import health_response, make_state
    from longreach.server.config import ServerConfig

    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=2, **ENGINE))
    try:
        state = make_state(engine, ServerConfig())
        state.loop.start()
        assert health_response(state.loop).status_code == 200
        worker = engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        assert wait_until(lambda: state.loop.dead, timeout=5)  # idle: found by the loop's wake-up check
        r = health_response(state.loop)
        assert r.status_code == 503
        message = json.loads(r.body)["error"]["message"]
        assert f"tensor-parallel rank 1 (pid {worker.pid}) died (exit code -9, killed by SIGKILL)" in message
        state.loop.stop()
    finally:
        engine.close()
    assert engine.workers is None and pid_gone(worker.pid)


# ---- torchrun ---------------------------------------------------------------------------------------------------------
def test_torchrun_generate_equals_tp1(model, one):
    prompt = "w5 w9 w100 w17 w3 w42 w77 w200 w11 w12 w13 w14 w15 w16 w18 w19 w20"  # 17 tokens: two prefill chunks
    want = one.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "longreach", "generate", "--model", model, "--prompt", prompt, "--max-tokens", "12",
           "--ignore-eos", "--no-progress", "--tensor-parallel-size", "2", *ENGINE_ARGS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == want.text and len(want.token_ids) == 12
    assert "launched by torchrun" in run.stderr


@pytest.mark.parametrize("env, message", [
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     r"torchrun started 2 processes \(WORLD_SIZE=2\) and --tensor-parallel-size is 4: they must be equal"),
    (dict(RANK="1", WORLD_SIZE="4"), "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"),
    (dict(RANK="x", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1"), "must be integers"),
])
def test_torchrun_environment_is_checked(monkeypatch, env, message):
    from longreach.engine.tp_workers import torchrun_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env(4) is None  # not under torchrun
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        torchrun_env(4)
