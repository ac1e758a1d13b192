"""The standing coverage-guided fuzzer (fuzz/fuzz_reader.py, atheris) runs for a bounded time in CI:
any exception other than a KvtoolError, a hang or a runaway allocation fails it."""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECONDS = int(os.environ.get("KVTOOL_FUZZ_SECONDS", "45"))

# libFuzzer's -rss_limit_mb compares the process's *peak* RSS (getrusage's ru_maxrss) with the
# limit, and Linux carries ru_maxrss across execve: a child that Python starts with vfork + exec
# (subprocess's default since 3.10) begins with its parent's peak RSS, here the pytest process's,
# which holds torch and models from earlier tests. A pytest process that once peaked above 2 GB
# made the fuzzer report "out-of-memory" within its first second, on whatever input it was running.
# A small launcher process in between gives the fuzzer a fresh count: the launcher's own memory
# (~10 MB) is all its child inherits.
LAUNCHER = """
import subprocess, sys
code = subprocess.call(sys.argv[1:])
sys.exit(128 - code if code < 0 else code)
"""


def with_own_peak_rss(argv: list[str]) -> list[str]:
    """`argv`, run through a launcher so that its ru_maxrss counts its own memory only."""
    return [sys.executable, "-c", LAUNCHER, *argv]


class Fuzzing:
    """fuzz/SCRIPT running for `seconds` on an empty corpus (which the script may seed) and any
    further corpus folders, through the launcher, its log in a file (so that two can run at once:
    each fuzzer is one thread, and on a machine of two cores two of them, each on its own core,
    run as many inputs as each would alone, in the time of the longer)."""

    def __init__(self, script: str, workdir: Path, seconds: int, *corpora: Path, env: dict | None = None):
        self.workdir, self.seconds, self.corpus = workdir, seconds, workdir / "corpus"
        self.corpus.mkdir()
        # inputs that once failed (fuzz/regressions/NAME/, NAME the script's without fuzz_) run first, every
        # time (libFuzzer writes new inputs to the first folder only: the empty corpus)
        regressions = REPO / "fuzz" / "regressions" / script.removeprefix("fuzz_").removesuffix(".py")
        corpora = (*corpora, regressions) if regressions.is_dir() else corpora
        self._log = (workdir / "fuzzer.log").open("w+")
        self._proc = subprocess.Popen(with_own_peak_rss([sys.executable, str(REPO / "fuzz" / script),
                                                         f"-max_total_time={seconds}", "-rss_limit_mb=2048",
                                                         "-timeout=10", f"-artifact_prefix={workdir}/",
                                                         str(self.corpus), *map(str, corpora)]),
                                      stdout=subprocess.DEVNULL, stderr=self._log, cwd=workdir, env=env)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Its exit status and its log, once it is done (killed past `timeout` s)."""
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise
        self._log.seek(0)
        return code, self._log.read()

    def crashes(self) -> list[str]:
        return sorted(p.name for p in self.workdir.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))

    def check(self, min_runs: int) -> Path:
        """Fails on any crash, hang or runaway allocation, or on fewer than `min_runs` inputs. The corpus."""
        code, log = self.finish(timeout=self.seconds + 180)
        crashes = self.crashes()
        assert code == 0 and not crashes, (crashes, log[-4000:])
        runs = re.search(r"Done (\d+) runs", log)
        assert runs and int(runs.group(1)) > min_runs, log[-2000:]
        return self.corpus


def run_fuzzer(script: str, tmp_path: Path, seconds: int, min_runs: int, env: dict | None = None) -> Path:
    """fuzz/SCRIPT for `seconds` on an empty corpus (which the script may seed), through the launcher;
    fails on any crash, hang or runaway allocation, or on fewer than `min_runs` inputs. The corpus."""
    return Fuzzing(script, tmp_path, seconds, env=env).check(min_runs)


#: Fuzzers of two modules that run side by side, each in one thread (torch's pool of two would
#: contend for the other core): the first module's test starts both when both are selected, the
#: second's finds its own running or done. {test (file::name): (script, seconds, environment)}.
CODEC_PARAMS = "test_fuzz_codec_params.py::test_the_codec_params_fuzzer_finds_nothing_in_its_time"
STORE_URLS = "test_fuzz_store_urls.py::test_the_store_url_fuzzer_finds_nothing_in_its_time"
SIDE_BY_SIDE = {
    CODEC_PARAMS: ("fuzz_codec_params.py", int(os.environ.get("KVTOOL_FUZZ_CODEC_PARAMS_SECONDS", "20")),
                   {"KVTOOL_CALIBRATION_PATH": str(REPO / "format-spec" / "vectors" / "pca")}),
    STORE_URLS: ("fuzz_store_urls.py", 20, {}),
}
PARTNER = {CODEC_PARAMS: STORE_URLS, STORE_URLS: CODEC_PARAMS}
_started_beside: dict[str, Fuzzing] = {}


def fuzzing_beside_its_partner(request) -> Fuzzing:
    """The calling test's fuzzing (a SIDE_BY_SIDE test): started by its partner's test, or now,
    with its partner's when that test is selected and has not run."""
    own = f"{request.node.path.name}::{request.node.name}"
    if own in _started_beside:
        return _started_beside.pop(own)
    factory = request.getfixturevalue("tmp_path_factory")

    def start(name: str) -> Fuzzing:
        script, seconds, env = SIDE_BY_SIDE[name]
        return Fuzzing(script, factory.mktemp(script.removesuffix(".py")), seconds,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})

    partner = PARTNER[own]
    if any(f"{item.path.name}::{item.name}" == partner for item in request.session.items) \
            and partner not in _ran_beside:
        _started_beside[partner] = start(partner)
    _ran_beside.add(own)
    return start(own)


_ran_beside: set[str] = set()


READER, STORE = "test_the_reader_fuzzer_finds_nothing_in_its_time", "test_the_store_fuzzer_finds_nothing_in_its_time"


@pytest.fixture(scope="module")
def standing_fuzzers(request, tmp_path_factory) -> dict[str, Fuzzing]:
    """The fuzzers of this module's selected tests, started together (each its own thread, its own
    core): {test name: its fuzzing}. Each test waits for its own and checks it."""
    here = [item.name for item in request.session.items if item.path == Path(__file__)]
    started = {}
    if READER in here:
        started[READER] = Fuzzing("fuzz_reader.py", tmp_path_factory.mktemp("reader-fuzz"), SECONDS,
                                  REPO / "format-spec" / "vectors")
    if STORE in here:
        # one thread: torch's pool of two would contend with the other fuzzer for the second core
        started[STORE] = Fuzzing("fuzz_store.py", tmp_path_factory.mktemp("store-fuzz"), max(10, SECONDS * 2 // 3),
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield started
    for fuzzing in started.values():
        if fuzzing._proc.poll() is None:
            fuzzing._proc.kill()


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_reader_fuzzer_finds_nothing_in_its_time(standing_fuzzers):
    fuzzing = standing_fuzzers[READER]
    code, log = fuzzing.finish(timeout=SECONDS + 120)
    crashes = fuzzing.crashes()
    rss = re.findall(r"rss: (\d+)Mb", log)
    assert code == 0 and not crashes, (
        crashes, f"fuzzer rss first/last: {rss[:1]}/{rss[-1:]} MB; this process's peak: "
                 f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MB", log[-4000:])
    assert "Done" in log and "runs in" in log


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed (pip install atheris)")
def test_the_store_fuzzer_finds_nothing_in_its_time(standing_fuzzers):
    """fuzz/fuzz_store.py: chunk objects from memory, from files cut short after they were opened,
    and under fsck (issue 27): a refusal or a clean load, never anything else."""
    standing_fuzzers[STORE].check(min_runs=100)


_PEAK_PROBE = """
import resource, subprocess, sys
sys.path.insert(0, sys.argv[1])
from test_fuzz_standing import with_own_peak_rss
child = [sys.executable, "-c", "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)"]
ballast = bytearray(512 << 20)
ballast[::4096] = b"\\1" * len(ballast[::4096])  # touch every page: 512 MB resident
del ballast  # freed: the probe's peak stays 512 MB, its current RSS drops
plain = int(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
launched = int(subprocess.run(with_own_peak_rss(child), capture_output=True, text=True, check=True).stdout)
print(plain, launched)
"""


def test_the_fuzzer_is_charged_for_its_own_memory_only():
    """A process whose peak RSS was 512 MB starts children: started directly, a child's ru_maxrss
    (what -rss_limit_mb checks) begins at its parent's peak; through `with_own_peak_rss` it is
    the child's own."""
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plain, launched = map(int, out.stdout.split())
    assert launched < 200, f"a launched child starts at {launched} MB peak RSS (its parent's was 512 MB)"
    if plain < 512:  # pragma: no cover - a kernel or Python that does not carry the peak over
        pytest.skip(f"here a child does not inherit its parent's peak RSS ({plain} MB): nothing to guard")
