"""Manifests that cost more than their file is worth (issue 27, item 7; format-spec/container.md
section 5, "Limits"): each limit refused with its error, on real files, and the output of verify
and inspect bounded on the largest file the limits allow.

Before the limits a manifest of 250,000 empty chunks took `verify` 33 s and 15.9 MB of output,
and one of 5.1 million keys under an unknown top-level key took 1.2 GB to open.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from crc32c import crc32c

from fixtures import ref_prefix_hashes, rebuild, split_file, write_kv_file
from kvtool.errors import ManifestCorrupt, ManifestInvalid
from kvtool.format import ContainerReader
from kvtool.format import manifest as manifest_module

MAX_CHUNKS = 65536  # spelled out (not imported from kvtool.format.layout): what the spec says
MAX_SEPARATORS = 3_145_728
MAX_FREE_FORM = 65536


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A valid file to build the hostile ones from: 8 tokens in chunks of 4, raw."""
    return write_kv_file(tmp_path_factory.mktemp("limits") / "small.kvc", num_tokens=8, chunk_size=4)


def _put(tmp_path, source, doc, name="bad.kvc"):
    """`source` with manifest `doc` (compact JSON, CRC by the crc32c package: a 16 MB manifest is
    too much for the bit-by-bit reference CRC)."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    path = tmp_path / name
    path.write_bytes(rebuild(source, manifest_raw=raw, crc=crc32c(raw)))
    return path


def _with(small, mutate):
    doc = split_file(small.path).manifest
    mutate(doc)
    return doc


# --- chunks per file --------------------------------------------------------------------------------


def test_more_chunks_than_a_file_may_hold(small, tmp_path):
    """65,537 tokens at chunk size 1 are 65,537 chunks: refused from `sequence`, before the
    chunk list is looked at."""
    def mutate(doc):
        doc["sequence"].update(num_tokens=MAX_CHUNKS + 1, chunk_size=1)
        doc["sequence"]["tokens"]["length"] = 4 * (MAX_CHUNKS + 1)
    with pytest.raises(ManifestInvalid, match=f"are {MAX_CHUNKS + 1} chunks; a file holds at most {MAX_CHUNKS}"):
        ContainerReader(_put(tmp_path, small.path, _with(small, mutate)))


def _many_chunks(small, count: int):
    """A manifest of `count` one-token chunks with empty payloads (each a DecodeError when read)."""
    doc = split_file(small.path).manifest
    tokens = [i % 1000 for i in range(count)]
    entry = doc["chunks"][0]
    doc["sequence"] = {"num_tokens": count, "chunk_size": 1,
                       "tokens": {**doc["sequence"]["tokens"], "length": 4 * count}}
    doc["chunks"] = [{**entry, "start": i, "end": i + 1, "prefix_hash": h, "offset": 64, "length": 0, "crc32": 0,
                      "shape": [2, entry["shape"][1], 1, entry["shape"][3]]}
                     for i, h in enumerate(ref_prefix_hashes(tokens, 1))]
    return doc, tokens


@pytest.fixture(scope="module")
def most_chunks(small, tmp_path_factory):
    """The largest chunk list the format allows, 65,536 empty chunks (a 16 MB manifest): the
    worst a file can make verify and inspect list."""
    import struct

    doc, tokens = _many_chunks(small, MAX_CHUNKS)
    parts = split_file(small.path)
    data = bytearray(parts.data[:64])  # the header, then the token ids where the manifest says
    data += bytes(doc["sequence"]["tokens"]["offset"] - 64) + struct.pack(f"<{len(tokens)}I", *tokens)
    doc["sequence"]["tokens"]["crc32"] = crc32c(bytes(data[doc["sequence"]["tokens"]["offset"]:]))
    raw = json.dumps(doc, separators=(",", ":")).encode()
    path = tmp_path_factory.mktemp("limits") / "most.kvc"
    path.write_bytes(rebuild(small.path, manifest_raw=raw, crc=crc32c(raw), data=bytes(data)))
    return path


def test_verify_lists_at_most_100_problems(most_chunks):
    """One problem a chunk, 65,536 of them: verify names 100 and counts the rest, in one error line."""
    done = subprocess.run([sys.executable, "-c", "import sys; from kvtool.cli.app import run; sys.exit(run())",
                           "verify", "--json", str(most_chunks)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"kvtool: error: verify failed: chunk 0: raw payload holds 0 bytes, shape needs 128 (and {MAX_CHUNKS - 1} more)"]
    report = json.loads(done.stdout)
    assert len(report["problems"]) == len(report["problem_types"]) == 100
    assert report["problems_omitted"] == MAX_CHUNKS - 100
    assert len(report["chunks"]) == MAX_CHUNKS  # --json: every chunk's status


def test_inspect_lists_at_most_1000_chunks(most_chunks):
    from kvtool.ops.inspect import inspect

    summary = inspect(most_chunks)
    assert [row["index"] for row in summary.chunks] == list(range(1000))
    assert summary.chunks_omitted == MAX_CHUNKS - 1000 and summary.num_chunks == MAX_CHUNKS
    assert summary.totals["bad_checksums"] == 0 and summary.totals["stored_bytes"] == 0  # totals: every chunk
    everything = inspect(most_chunks, all_chunks=True)
    assert len(everything.chunks) == MAX_CHUNKS and everything.chunks_omitted == 0


def test_the_cli_says_what_it_left_out(most_chunks, capsys):
    """The plain renderings name what is not listed: verify the problems past 100, inspect the
    chunks past 1,000 (and `--all` lists them)."""
    from kvtool.cli.app import run

    assert run(["verify", str(most_chunks)]) == 1
    out = capsys.readouterr().out
    # the 100 listed, all alike, on one line that names their chunks (issue 51: one line, not 100)
    assert "FAIL chunks 0-99: raw payload holds 0 bytes" in out and out.count("FAIL") == 2
    assert f"and {MAX_CHUNKS - 100} more problems (not listed)" in out
    assert f"{MAX_CHUNKS} problems" in out
    assert run(["inspect", str(most_chunks)]) == 0
    out = capsys.readouterr().out
    assert f"{MAX_CHUNKS - 1000} more chunks (--all lists them)" in out
    assert run(["inspect", "--all", "--json", str(most_chunks)]) == 0
    assert len(json.loads(capsys.readouterr().out)["chunks"]) == MAX_CHUNKS


# --- JSON values (`,` and `:` outside strings) ------------------------------------------------------


def test_more_json_values_than_the_format_allows(small, tmp_path):
    """3,145,729 separators (a list of zeros under an unknown key): refused before parsing."""
    path = _put(tmp_path, small.path, _with(small, lambda d: d.__setitem__("zzz", [0] * (MAX_SEPARATORS + 2))))
    with pytest.raises(ManifestCorrupt, match=r"JSON values \(',' and ':' outside strings\); the format allows 3145728"):
        ContainerReader(path)


def test_separators_inside_strings_do_not_count(small, tmp_path):
    """A string of 4 million commas and colons is one value."""
    path = _put(tmp_path, small.path, _with(small, lambda d: d["metadata"].__setitem__("note", ",:" * 2_000_000)))
    with ContainerReader(path) as reader:
        assert len(reader.manifest.metadata["note"]) == 4_000_000


def _reference_counts(text: str) -> tuple[int, int]:
    outside = re.sub(r'"[^"\\]*(?:\\.[^"\\]*)*"', "", text)
    return outside.count("{") + outside.count("["), outside.count(",") + outside.count(":")


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64, 1 << 20])
def test_counting_outside_strings_matches_a_reference(monkeypatch, block):
    """The block-wise count agrees with removing the strings first, whatever the blocks cut:
    escaped quotes, runs of backslashes, multi-byte characters."""
    import random

    monkeypatch.setattr(manifest_module, "_SCAN_BLOCK", block)
    rng = random.Random(block)
    pieces = ["a", ",", ":", "{", "[", "\\", '"', "é", "\n", "}", "]", "\\\\", '\\"']

    def value(depth=0):
        kind = rng.random()
        if depth > 3 or kind < 0.3:
            return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        if kind < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {"".join(rng.choice(pieces) for _ in range(rng.randint(0, 5))): value(depth + 1)
                for _ in range(rng.randint(0, 4))}
    for i in range(200):
        text = json.dumps(value(), ensure_ascii=bool(i % 2))
        assert manifest_module.outside_strings(text.encode()) == _reference_counts(text), text


# --- free-form content: model, metadata, unknown top-level keys ---------------------------------------


def test_more_free_form_values_than_the_format_allows(small, tmp_path):
    """65,537 keys under a key this version does not define."""
    path = _put(tmp_path, small.path, _with(small, lambda d: d.__setitem__(
        "zzz", {f"k{i}": 0 for i in range(MAX_FREE_FORM + 1)})))
    with pytest.raises(ManifestInvalid, match="unknown top-level keys hold more than 65536 JSON values"):
        ContainerReader(path)


def test_free_form_values_count_metadata_and_model_too(small, tmp_path):
    def mutate(doc):
        doc["metadata"].update({f"m{i}": "" for i in range(MAX_FREE_FORM // 2)})
        doc["model"]["extra"] = {"layers": [[0, 1]] * (MAX_FREE_FORM // 4)}  # two values an element, and the element
    with pytest.raises(ManifestInvalid, match="more than 65536 JSON values"):
        ContainerReader(_put(tmp_path, small.path, _with(small, mutate)))


def test_free_form_values_under_the_limit_are_read(small, tmp_path):
    path = _put(tmp_path, small.path, _with(small, lambda d: d.__setitem__("zzz", {f"k{i}": 0 for i in range(60000)})))
    with ContainerReader(path) as reader:
        assert len(reader.manifest.extensions["zzz"]) == 60000
