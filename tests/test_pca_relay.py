"""pca's coefficients re-laid between bitstream layouts (kvtool/codecs/pca/relay.py): version 1 to
version 2 and back, and another `lanes` or `unit`, give the bytes the writer gives the same KV in
that layout, never decoding to values (no second rounding) and reading no calibration object;
`compress_file` re-lays a pca file's chunks this way (and only those: another quality or codec is
decoded and encoded); a damaged payload is refused as a reader refuses it, named by its chunk,
within the memory its shape and length allow.

The command line on the real model: tests/test_pca_model.py (a version-1 file to version 2 and back)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvtool.codecs.pca import PcaCodec
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import reference as v1
from kvtool.codecs.pca import reference2 as v2
from kvtool.codecs.pca.relay import can_relay, relay
from kvtool.errors import KvtoolError

from test_pca_native import raw_kv
from test_pca_v2 import cal_of

CASES = [  # (L, H, D), tokens, dtype, sinks, position, step, (lanes, other lanes), (unit, other unit)
    ((2, 2, 8), 40, "bfloat16", 4, 0, 0.5, (16, 3), (64, 128)),
    ((1, 3, 10), 33, "float16", 4, 2, 0.25, (7, 16), (128, 64)),
    ((2, 2, 16), 70, "float32", 0, 1000, 1.0, (64, 1), (192, 4096)),
    ((2, 2, 16), 256, "bfloat16", 4, 0, 0.8, (16, 64), (768, 512)),
    ((1, 2, 8), 3, "bfloat16", 4, 0, 1.0, (16, 2), (512, 768)),  # sinks only: no coefficient
]
DIGEST = "ab" * 32  # (relaying reads no calibration: the parameters only name one)


def params(version: int, layout: int, step: float, sinks: int, position: int) -> dict:
    key = "lanes" if version == 1 else "unit"
    return {"version": version, "calibration": DIGEST, "quality": "97", "step": step, "sinks": sinks, key: layout,
            "position": position}


@pytest.mark.parametrize("geometry, tokens, dtype, sinks, position, step, lanes, unit", CASES)
def test_relaid_payloads_are_the_writers_bytes_in_the_other_layout(geometry, tokens, dtype, sinks, position, step,
                                                                   lanes, unit):
    cal = cal_of(*geometry)
    raw = raw_kv(cal, tokens, dtype, seed=tokens)
    one = {n: v1.encode_chunk(raw, dtype, cal, step, sinks, position, n) for n in lanes}
    two = {n: v2.encode_chunk(raw, dtype, cal, step, sinks, position, n) for n in unit}
    # (both versions quantize to the same coefficients here: §11.5's tables equal libm's at these positions)
    assert np.array_equal(v1.decode_coefficients(one[lanes[0]], raw.shape, dtype)[1],
                          v2.decode_coefficients(two[unit[0]], raw.shape, dtype)[1])
    p = {(1, n): params(1, n, step, sinks, position) for n in lanes} | \
        {(2, n): params(2, n, step, sinks, position) for n in unit}
    payloads = {(1, n): b for n, b in one.items()} | {(2, n): b for n, b in two.items()}
    for source in payloads:
        for target in payloads:
            if source != target:
                assert relay(payloads[source], raw.shape, dtype, p[source], p[target]) == payloads[target], \
                    (source, target)


def test_the_codec_relays_only_the_same_coefficients():
    """Another step, quality, calibration, sink count or position is other coefficients: not
    re-laid (the caller decodes and encodes); identical parameters: nothing to re-lay; no other
    codec re-lays."""
    from kvtool.codecs import get_codec

    cal = cal_of(2, 2, 8)
    raw = raw_kv(cal, 40, "bfloat16", seed=40)
    codec = PcaCodec()
    source = params(1, 16, 0.5, 4, 0)
    payload = memoryview(v1.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 16))
    target = params(2, 768, 0.5, 4, 0)
    assert codec.relays(source, target) and codec.relay(payload, raw.shape, "bfloat16", source, target) == \
        v2.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 0, 768)
    assert can_relay(codec.validate_params(source), codec.validate_params(params(1, 3, 0.5, 4, 0)))
    for key, value in (("step", 0.25), ("quality", "95"), ("calibration", "cd" * 32), ("sinks", 0), ("position", 4)):
        assert not codec.relays(source, {**target, key: value}), key
    assert not codec.relays(source, dict(source))
    for name in ("raw", "zstd", "cachegen"):
        other = get_codec(name)
        assert not other.relays(other.default_params(), other.default_params())
        with pytest.raises(NotImplementedError):
            other.relay(payload, raw.shape, "bfloat16", other.default_params(), other.default_params())


def test_a_hostile_region_table_asks_for_no_more_memory_than_the_chunk_and_payload():
    """One long region and thousands of short ones (pca.md §11.4: a reader MUST NOT allocate
    beyond the chunk's shape and the payload's length). The reference once held every unit's
    stream in a units-by-longest-region array: 4,096 units x 65,537 x 8 bytes, 2.1 GB, for this
    82 KB payload; now the streams back to back."""
    import tracemalloc

    L, T, C, unit = 2, 256, 256, 64
    rows, units = 2 * L, 2 * L * C * T // unit
    regions = [65535] + [8] * (units // 2 - 1)
    payload = (v2.HEADER.pack(b"KVPC", 2, 0, unit // 64, 0, rows, T, C, 0) + bytes(rows * C)  # live, table 0
               + np.array(regions, "<u2").tobytes() + bytes(random.Random(3).randrange(256) for _ in range(sum(regions))))
    tracemalloc.start()
    try:
        with pytest.raises(KvtoolError):
            PcaCodec().relay(memoryview(payload), (2, L, T, C), "bfloat16", params(2, unit, 1.0, 0, 0),
                             params(1, 16, 1.0, 0, 0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200e6, peak  # (the shape's own arrays: units x steps of int64, a few times)


def test_a_damaged_payload_is_refused_never_a_crash():
    """Bytes flipped, cut or added in either version: a refusal (a KvtoolError, one line at the
    command line) or, where the damage still reads as coefficients, a payload that decodes."""
    cal = cal_of(2, 2, 8)
    raw = raw_kv(cal, 40, "bfloat16", seed=40)
    codec = PcaCodec()
    rng = random.Random(7)
    refused = 0
    for version, layout, make in ((1, 16, v1.encode_chunk), (2, 64, v2.encode_chunk)):
        good = make(raw, "bfloat16", cal, 0.5, 4, 0, layout)
        source, target = params(version, layout, 0.5, 4, 0), params(3 - version, 64 if version == 1 else 16, 0.5, 4, 0)
        for trial in range(150):
            bad = bytearray(good)
            if trial % 3 == 0:
                bad = bad[:rng.randrange(len(bad))]
            elif trial % 3 == 1:
                for _ in range(rng.randint(1, 4)):
                    bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
            else:
                bad[rng.randrange(len(bad)):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
            try:
                out = codec.relay(memoryview(bytes(bad)), raw.shape, "bfloat16", source, target)
            except KvtoolError as err:
                assert "\n" not in str(err)
                refused += 1
            else:
                (v1 if version == 2 else v2).decode_coefficients(out, raw.shape, "bfloat16")
    assert refused > 200  # (most damage is seen)


VECTORS = Path(__file__).resolve().parents[1] / "format-spec" / "vectors" / "pca"
CALIBRATION = json.loads((VECTORS / "bf16_sinks.json").read_text())["params"]["calibration"]  # 2 layers, 8 channels
ONE = {"version": 1, "calibration": CALIBRATION, "quality": "97", "step": 0.8, "sinks": 4, "lanes": 16}
TWO = {"version": 2, "calibration": CALIBRATION, "quality": "97", "step": 0.8, "sinks": 4, "unit": 64}


def pca_file(tmp_path: Path, monkeypatch) -> Path:
    """A version-1 pca file of 40 tokens in 3 chunks (the vectors' calibration: 2 layers, one KV
    head of 8), written with the calibration found; then the calibration hidden again."""
    import torch

    from kvtool.format import ContainerWriter
    from kvtool.identity import ModelIdentity

    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(VECTORS))
    monkeypatch.setattr(calmod, "_loaded", {})
    identity = ModelIdentity(name="tiny", architecture="LlamaForCausalLM", num_layers=2, num_attention_heads=2,
                             num_kv_heads=1, head_dim=8, hidden_size=16, intermediate_size=32, vocab_size=1000,
                             rms_norm_eps=1e-5, tie_word_embeddings=True,
                             rope={"rope_theta": 10000.0, "rope_scaling": None})
    kv = (torch.randn(2, 2, 40, 8, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    writer = ContainerWriter(tmp_path / "v1.kvc", identity, list(range(100, 140)), kv_dtype=torch.bfloat16,
                             chunk_size=16)
    for start, end in writer.chunk_ranges():
        writer.write_chunk(kv[:, :, start:end], "pca", dict(ONE, position=start))
    writer.finish()
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(tmp_path / "nowhere"))  # the object is not here
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "no-calibrations"))
    monkeypatch.setattr(calmod, "_loaded", {})
    return tmp_path / "v1.kvc"


def test_compress_relays_a_pca_file_without_its_calibration(tmp_path, monkeypatch):
    """`compress_file` of a version-1 pca file to version 2 re-lays every chunk (chunks_relaid) on
    a machine without the calibration object, and back (the parameters given in part); a file
    already in the target is copied; with the object, the values read are the version-1 file's.
    Without re-laying (`store get`'s way) or to another quality: decoded and encoded."""
    from kvtool.format import ContainerReader
    from kvtool.ops.compress import compress_file

    source = pca_file(tmp_path, monkeypatch)
    with ContainerReader(source) as reader:
        done = compress_file(reader, tmp_path / "v2.kvc", "pca", TWO)
    assert (done.chunks_relaid, done.chunks_copied, done.num_chunks) == (3, 0, 3)
    with ContainerReader(tmp_path / "v2.kvc") as reader:
        done = compress_file(reader, tmp_path / "back.kvc", "pca", {k: v for k, v in ONE.items() if k != "lanes"})
    assert (done.chunks_relaid, done.chunks_copied) == (3, 0)
    with ContainerReader(tmp_path / "back.kvc") as reader:  # already version 1: copied, not re-laid
        done = compress_file(reader, tmp_path / "again.kvc", "pca", ONE)
    assert (done.chunks_relaid, done.chunks_copied) == (0, 3)

    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(VECTORS))
    codec = PcaCodec()
    with ContainerReader(source) as a, ContainerReader(tmp_path / "v2.kvc") as b, \
            ContainerReader(tmp_path / "back.kvc") as c:
        for entry in b.chunks:
            assert entry.codec_params == codec.validate_params(dict(TWO, position=entry.start))
            assert np.array_equal(a.read_chunk_array(entry.index), b.read_chunk_array(entry.index))
            assert bytes(c.chunk_payload(entry.index)) == bytes(a.chunk_payload(entry.index))  # the same bytes
    with ContainerReader(source) as reader:
        done = compress_file(reader, tmp_path / "slow.kvc", "pca", TWO, relay=False)
        other = compress_file(reader, tmp_path / "q.kvc", "pca", dict(TWO, step=0.5, quality="95"))
    assert (done.chunks_relaid, other.chunks_relaid) == (0, 0)


def test_a_chunk_that_fails_to_relay_is_named(tmp_path, monkeypatch):
    """A chunk whose payload is damaged but whose CRC agrees (a writer's bug, not the disk's): the
    refusal names the chunk, as a decode's does, and no output is left."""
    from fixtures import patch_blob, split_file
    from kvtool.errors import DecodeError
    from kvtool.format import ContainerReader
    from kvtool.ops.compress import compress_file

    source = pca_file(tmp_path, monkeypatch)
    ref = split_file(source).manifest["chunks"][1]  # (its offset, length and crc32)
    payload = Path(source).read_bytes()[ref["offset"]:ref["offset"] + ref["length"]]
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(patch_blob(source, ref, payload[:-4]))
    with ContainerReader(bad) as reader, pytest.raises(DecodeError, match=r"^chunk 1: pca: "):
        compress_file(reader, tmp_path / "v2.kvc", "pca", TWO)
    assert not (tmp_path / "v2.kvc").exists()
