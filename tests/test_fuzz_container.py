"""Exhaustive and fuzzed damage to container files: every truncation, every flipped byte,
random byte mutations, and structural damage to the manifest behind a correct CRC-32C.

The contract under test (format-spec/container.md §5): opening and reading a damaged file either
succeeds with the original data or raises a `KvtoolError` — never another exception, never a
hang. The valid starting points (`fast_dir`, `raw_file`, `zstd_file`) are in tests/conftest.py;
hand-written one-case tests for each error class are in test_bad_input.py.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.ops.inspect import summarize
from kvtool.ops.verify import check_file
from kvtool.errors import (
    ChecksumMismatch,
    DecodeError,
    KvtoolError,
    ManifestCorrupt,
    NotAKvtoolFile,
    TruncatedFile,
)
from kvtool.format import ContainerReader

from fixtures import (
    blob_bytes,
    chunk_entry,
    flip_byte,
    mutated,
    patch_blob,
    put,
    read_everything,
    rebuild,
    same_content,
    split_file,
    time_limit,
)


# --- every truncation, every flipped byte ----------------------------------------------------------


def _outcome(path: Path, expected: dict):
    """None if the file read back identically, else the KvtoolError class; anything else fails."""
    try:
        got = read_everything(path)
    except KvtoolError as err:
        assert str(err) and "\n" not in str(err)
        return type(err)
    assert same_content(got, expected), "a damaged file read back different data without an error"
    return None


@pytest.mark.parametrize("which", ["raw", "zstd"])
def test_truncated_at_every_byte(fast_dir, raw_file, zstd_file, which):
    f = raw_file if which == "raw" else zstd_file
    data = f.path.read_bytes()
    expected = read_everything(f.path)
    path = fast_dir / f"trunc-{which}.kvc"
    with time_limit(60):
        for n in range(len(data)):
            path.write_bytes(data[:n])
            assert _outcome(path, expected) is TruncatedFile, n


@pytest.mark.parametrize("which", ["raw", "zstd"])
def test_every_byte_flipped(fast_dir, raw_file, zstd_file, which):
    f = raw_file if which == "raw" else zstd_file
    data = f.path.read_bytes()
    expected = read_everything(f.path)
    path = fast_dir / f"flip-{which}.kvc"
    rng = random.Random(1234)
    seen: dict = {}
    with time_limit(60):  # every byte inverted, and every third byte XORed with a random mask
        for i in range(len(data)):
            for mask in (0xFF, rng.randrange(1, 255)) if i % 3 == 0 else (0xFF,):
                path.write_bytes(flip_byte(data, i, mask))
                kind = _outcome(path, expected)
                seen[kind] = seen.get(kind, 0) + 1
    # every region of the file was hit: header, blobs, manifest, trailer
    assert {NotAKvtoolFile, ChecksumMismatch, ManifestCorrupt, TruncatedFile} <= set(seen)


def test_decode_error_zstd_corrupt_blocks(tmp_path, zstd_file):
    """Flip every byte of a zstd payload (CRC recomputed): DecodeError or some decoded tensor."""
    ref = chunk_entry(zstd_file)
    payload = blob_bytes(zstd_file.path, ref)
    outcomes = {"decode-error": 0, "decoded": 0}
    for i in range(len(payload)):
        path = put(tmp_path, patch_blob(zstd_file.path, ref, flip_byte(payload, i, 0xFF)))
        with ContainerReader(path) as r:
            try:
                t = r.read_chunk(0)
            except DecodeError:
                outcomes["decode-error"] += 1
            else:  # a frame without a content checksum can decode to other values: right shape
                assert t.shape == zstd_file.chunk(0).shape and t.dtype == torch.float32
                outcomes["decoded"] += 1
    assert outcomes["decode-error"] > 0


# --- fuzzing -------------------------------------------------------------------------------------------

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 64)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
)


def _apply(data: bytes, ops) -> bytes:
    out = bytearray(data)
    for op, pos, arg in ops:
        pos %= max(len(out), 1)
        if op == "flip" and out:
            out[pos] ^= arg
        elif op == "set" and out:
            out[pos] = arg
        elif op == "insert":
            out[pos:pos] = arg
        elif op == "delete":
            del out[pos:pos + arg]
    return bytes(out)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(mutation, min_size=1, max_size=6), which=st.sampled_from(["raw", "zstd"]))
def test_fuzz_byte_mutations(fast_dir, raw_file, zstd_file, ops, which):
    f = raw_file if which == "raw" else zstd_file
    path = fast_dir / "fuzz.kvc"
    path.write_bytes(_apply(f.path.read_bytes(), ops))
    with time_limit(10):
        _outcome(path, read_everything(f.path))


json_value = st.recursive(
    st.none() | st.booleans()
    | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 64, 2**31, 2**32, 2**63, 2**64])
    | st.floats(allow_nan=False, allow_infinity=False)
    # lone surrogates are excluded: test_bad_input.py::test_manifest_lone_surrogate covers them
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=5,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _edit(doc, path, action, value):
    if not path:
        return value if action == "replace" else doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if action == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    elif action == "replace":
        parent[last] = value
    elif action == "nudge" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] += value if isinstance(value, int) and not isinstance(value, bool) else 1
    return doc


def _extras_of(path: Path, original: dict) -> dict:
    """The original extras that `path` still declares."""
    try:
        with ContainerReader(path) as r:
            return {name: t for name, t in original["extras"].items() if name in r.manifest.extras}
    except KvtoolError:
        return original["extras"]


def _exercise(path: Path) -> None:
    """Everything a command would do with a file; only KvtoolError may come out."""
    try:
        reader = ContainerReader(path)
    except KvtoolError:
        return
    with reader:
        for call in ([lambda: reader.token_ids()]
                     + [lambda i=i: reader.read_chunk(i) for i in range(len(reader.chunks))]
                     + [lambda n=n: reader.read_extra(n) for n in reader.manifest.extras]
                     + [lambda: reader.read_range(0, reader.num_tokens)]):
            try:
                call()
            except KvtoolError:
                pass
        json.dumps(summarize(reader).to_dict(), default=str)
        try:
            check_file(reader)
        except KvtoolError:
            pass


@pytest.fixture(scope="module")
def manifests(raw_file, zstd_file):
    out = {}
    for name, f in (("raw", raw_file), ("zstd", zstd_file)):
        doc = split_file(f.path).manifest
        out[name] = (f, doc, list(_paths(doc)), read_everything(f.path))
    return out


@settings(max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.sampled_from(["raw", "zstd"]), where=st.integers(0, 10**6),
       action=st.sampled_from(["replace", "delete", "nudge"]), value=json_value)
def test_fuzz_manifest_with_valid_crc(fast_dir, manifests, which, where, action, value):
    """Structural damage behind a correct CRC: the manifest parser is the only line of defence."""
    f, doc, paths, original = manifests[which]
    doc = _edit(copy.deepcopy(doc), paths[where % len(paths)], action, value)
    path = fast_dir / "fuzz-manifest.kvc"
    path.write_bytes(rebuild(f.path, manifest=doc))
    with time_limit(10):
        _exercise(path)
        # what reads back at all reads back unchanged (extras are optional: a manifest without
        # them is a valid file without them)
        _outcome(path, dict(original, extras=_extras_of(path, original)))


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(i=st.integers(0, 2), j=st.integers(0, 2),
       field=st.sampled_from(["offset", "length", "crc32", "codec_params", "prefix_hash", "shape"]))
def test_fuzz_swapped_chunk_fields(fast_dir, raw_file, zstd_file, i, j, field):
    """Fields copied between chunk entries (a plausible writer bug): never a crash."""
    for f in (raw_file, zstd_file):
        def mutate(d):
            d["chunks"][i][field] = d["chunks"][j][field]
        path = fast_dir / "fuzz-swap.kvc"
        path.write_bytes(mutated(f, mutate))
        _exercise(path)
        _outcome(path, read_everything(f.path))  # what reads back at all reads back unchanged


@pytest.mark.parametrize("vector", ["raw_bf16.kvc", "cachegen_bf16.kvc"])
def test_every_single_byte_change_fails_verify(vector):
    """Every byte is CRC-covered, checked by a rule, or required to be zero (container.md §2.3): so
    any one changed byte, anywhere, makes verify report a problem or the reader refuse the file."""
    from kvtool.format import ContainerReader
    from kvtool.format.reader import BytesSource  # every mutant read without touching the disk

    original = (Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / vector).read_bytes()
    with ContainerReader(BytesSource(original, vector)) as reader:
        assert check_file(reader).ok
    clean = []
    for offset in range(len(original)):
        mutant = bytearray(original)
        mutant[offset] ^= 0x01 if offset % 2 else 0x80
        try:
            with ContainerReader(BytesSource(bytes(mutant), vector)) as reader:
                if check_file(reader).ok:
                    clean.append(offset)
        except KvtoolError:
            pass
    assert clean == []
