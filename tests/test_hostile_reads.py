"""A container cut short by another program while kvtool reads it (issue 27, item 6).

A local file is memory-mapped; where a read went through the mapping, pages past the file's new
end fault with SIGBUS and the process died ("Bus error", exit 135, nothing printed). Every read
of a container's bytes must instead refuse them in one line: ChecksumMismatch, "the file ends
inside the payload (stored bytes are damaged)", and a non-zero exit.

Two kinds of test, both with real files and real processes (a SIGBUS would end pytest itself, so
each read runs in a child process):

- deterministic: the child opens the file, the file is truncated, then the child reads (each
  reader method; each operation through its `on_chunk` hook, after its first chunk);
- racing: `kvtool verify` / `inspect --stats` / `dump` / `compress` run on a large file that is
  truncated once the command has mapped it, at a few delays, as the issue's reporter did.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fixtures import make_identity, write_kv_file

PYTHON = sys.executable
KVTOOL = [PYTHON, "-c", "import sys; from kvtool.cli.app import run; sys.exit(run())"]
CUT_TO = 4096  # the header's page stays; every blob is gone
TRUNCATED = "the file ends inside the payload"


def _child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout)


def _refused(done: subprocess.CompletedProcess, expected: str = "ChecksumMismatch") -> None:
    """The child ended on its own (no signal) with one kvtool error line naming the cut."""
    assert done.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), f"killed by SIGBUS: {done.stderr[-500:]}"
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("ERROR "), (done.returncode, done.stdout[-500:], done.stderr[-1500:])
    assert lines[-1].startswith(f"ERROR {expected}: ") and TRUNCATED in lines[-1], lines[-1]
    assert done.returncode == 1  # a DataError's exit code


@pytest.fixture(scope="module")
def paged_file(tmp_path_factory) -> Path:
    """bf16 raw chunks of 64 KiB (16 pages each), both extras, blobs page-aligned: a cut at 4096
    leaves whole pages of every blob past the end, which is what faults through a mapping."""
    path = tmp_path_factory.mktemp("hostile-reads") / "paged.kvc"
    write_kv_file(path, identity=make_identity(num_layers=2, num_kv_heads=2, head_dim=64, name="paged"),
                  num_tokens=256, chunk_size=64, alignment=4096, extras=True, token_ids=range(256))
    return path


def _fresh_copy(source: Path, tmp_path: Path, name: str = "cut.kvc") -> Path:
    target = tmp_path / name
    shutil.copyfile(source, target)
    return target


# --- deterministic: truncated after the reader opened the file, before it reads -------------------

READER_CALL = """
import os, sys
from kvtool.errors import KvtoolError
from kvtool.format import ContainerReader
path, cut, call = sys.argv[1], int(sys.argv[2]), sys.argv[3]
reader = ContainerReader(path)
os.truncate(path, cut)  # another program cuts the file short
try:
    result = eval(call, {"r": reader, "torch": __import__("torch")})
except KvtoolError as err:
    print(f"ERROR {type(err).__name__}: {err}")
    sys.exit(err.exit_code)
print("RESULT", repr(result)[:200])
"""

READS = {
    "token_ids": "r.token_ids()",
    "blob_bytes": "r.blob_bytes(r.chunks[1].blob)",
    "chunk_payload": "r.chunk_payload(1)",
    "chunk_payload_unchecked": "bytes(r.chunk_payload(1, verify=False))",
    "read_chunk_array": "r.read_chunk_array(1)",
    "read_chunk_array_unchecked": "r.read_chunk_array(1, verify=False).sum()",
    "read_chunk": "r.read_chunk(1)",
    "read_chunk_unchecked": "r.read_chunk(1, verify=False).sum()",
    "source_decode": "r.source(1).decode()",
    "source_copy_into": "r.source(1).copy_into(memoryview(bytearray(r.chunks[1].blob.length)))",
    "source_checked_payload": "bytes(r.source(1).checked_payload())",
    "decode_many": "type(r.source(0)).decode_many([r.source(0), r.source(1)], 'cpu')",
    "read_range": "r.read_range(0, 200)",
    "read_extra_array": "r.read_extra_array('hidden_states')",
    "read_extra": "r.read_extra('roi_mask')",
    "nonzero_padding": "r.nonzero_padding()",
}


@pytest.mark.parametrize("call", sorted(READS))
def test_reader_refuses_a_file_cut_after_open(paged_file, tmp_path, call):
    path = _fresh_copy(paged_file, tmp_path)
    _refused(_child(READER_CALL, str(path), str(CUT_TO), READS[call]))


def test_blob_ok_of_a_cut_file_is_false(paged_file, tmp_path):
    """blob_ok answers whether the stored bytes are intact: bytes that are gone are not."""
    path = _fresh_copy(paged_file, tmp_path)
    done = _child(READER_CALL, str(path), str(CUT_TO), "[r.blob_ok(c.blob) for c in r.chunks]")
    assert done.returncode == 0, (done.returncode, done.stderr[-1500:])
    assert done.stdout.strip() == "RESULT [False, False, False, False]"


OPERATION = """
import os, sys
from kvtool.errors import KvtoolError
import kvtool.ops.verify, kvtool.ops.inspect, kvtool.ops.dump, kvtool.ops.compress
path, cut, call, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cuts = []
def on_chunk(done, total):  # after the first chunk, another program cuts the file short
    if not cuts:
        cuts.append(done)
        os.truncate(path, cut)
try:
    eval(call, {"ops": kvtool.ops, "path": path, "out": out, "on_chunk": on_chunk})
except KvtoolError as err:
    print(f"ERROR {type(err).__name__}: {err}")
    sys.exit(err.exit_code)
print("NO ERROR", cuts)
"""

OPERATIONS = {
    "verify": "ops.verify.verify(path, on_chunk=on_chunk)",
    "inspect_stats": "ops.inspect.inspect(path, stats=True, on_chunk=on_chunk)",
    "dump_npy": "ops.dump.dump(path, out + '.npy', on_chunk=on_chunk)",
    "dump_safetensors": "ops.dump.dump(path, out + '.safetensors', on_chunk=on_chunk)",
    "compress_copy": "ops.compress.compress(path, out + '.kvc', 'raw', on_chunk=on_chunk)",
    "compress_zstd": "ops.compress.compress(path, out + '.kvc', 'zstd', on_chunk=on_chunk)",
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_operation_refuses_a_file_cut_while_it_reads(paged_file, tmp_path, operation):
    path = _fresh_copy(paged_file, tmp_path)
    done = _child(OPERATION, str(path), str(CUT_TO), OPERATIONS[operation], str(tmp_path / "out"))
    expected = "VerificationFailed" if operation == "verify" else "ChecksumMismatch"
    _refused(done, expected)
    assert not list(tmp_path.glob("out*")), "a refused operation leaves no output behind"


def test_verify_reports_the_cut_chunks_as_problems(paged_file, tmp_path):
    """verify goes on past a cut chunk: every chunk and extra whose bytes are gone is a problem."""
    path = _fresh_copy(paged_file, tmp_path)
    code = OPERATION.replace('print(f"ERROR {type(err).__name__}: {err}")',
                             'print(*getattr(err, "problems", []), sep="\\n"); print(f"ERROR {type(err).__name__}: {err}")')
    done = _child(code, str(path), str(CUT_TO), OPERATIONS["verify"], str(tmp_path / "out"))
    _refused(done, "VerificationFailed")
    problems = done.stdout.strip().splitlines()[:-1]
    assert [p for p in problems if p.startswith("chunk ")] == [f"chunk {i}: {TRUNCATED} (stored bytes are damaged)"
                                                                for i in (1, 2, 3)]
    assert sum(p.startswith("extra ") and TRUNCATED in p for p in problems) == 2


# --- racing: a real command, a real truncation while it reads ----------------------------------------


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    """64 MiB of raw bf16 KV in 64 chunks of 1 MiB, with both extras, page-aligned blobs."""
    folder = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.mktemp("race")
    path = folder / f"kvtool-race-{os.getpid()}.kvc"
    identity = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, name="race")
    kv = torch.full((2, 4, 16384, 256), 0.5, dtype=torch.bfloat16)
    write_kv_file(path, identity=identity, num_tokens=16384, chunk_size=256, alignment=4096, extras=True, kv=kv,
                  token_ids=[i % 1000 for i in range(16384)])
    yield path
    path.unlink(missing_ok=True)


def _mapped(pid: int, path: Path) -> bool:
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _race(command: list[str], path: Path, delay: float) -> subprocess.CompletedProcess:
    """Run `command`; once it has mapped `path` (its reader opened the file), wait `delay` and cut
    the file to 3,000,000 bytes (as the issue did)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while process.poll() is None and not _mapped(process.pid, path) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    os.truncate(path, 3_000_000)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


COMMANDS = {
    "verify": lambda path, out: ["verify", str(path)],
    "inspect --stats": lambda path, out: ["inspect", "--stats", str(path)],
    "dump": lambda path, out: ["dump", str(path), "-o", str(out / "dump.npy"), "--layers", "0"],
    "compress": lambda path, out: ["compress", str(path), "-o", str(out / "copy.kvc"), "--codec", "raw"],
}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when the file is mapped")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_refuses_a_file_cut_while_it_runs(big_file, tmp_path, command):
    for delay in (0.0, 0.02, 0.08):
        path = _fresh_copy(big_file, big_file.parent, f"{big_file.stem}-{command.split()[0]}.kvc")
        try:
            done = _race(KVTOOL + COMMANDS[command](path, tmp_path), path, delay)
        finally:
            path.unlink(missing_ok=True)
        assert done.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), \
            f"{command} (cut {delay} s after it mapped the file): killed by SIGBUS"
        errors = done.stderr.strip().splitlines()
        if done.returncode == 0:  # it had read everything before the cut (not seen here: the file is large)
            continue
        assert done.returncode in (1, 2) and len(errors) == 1 and errors[0].startswith("kvtool: error: "), \
            (command, delay, done.returncode, done.stderr[-2000:])
        assert any(words in errors[0] for words in (TRUNCATED, "file ended", "truncated")), errors[0]
