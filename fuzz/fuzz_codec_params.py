"""A standing coverage-guided fuzzer of codec parameters and files mixing codecs (atheris, libFuzzer's
engine; issue 46).

Every input is a recipe read with atheris' FuzzedDataProvider: which base file, then up to four
edits of its chunks' `codec_params`, with the manifest's CRC-32C recomputed so that each edit
reaches the parser and the decoders. The base files, written once at start-up in memory, are one
per codec (raw, zstd, cachegen, pca) and one mixing all four, chunk by chunk (what `store get` gives
after a prefix was stored in several codecs). An edit sets a parameter the codec defines, or an
unknown one, to an edge value (`[]`, `{}`, `null`, negatives, huge integers, floats, `"NaN"`, other
types) or to a value the fuzzer makes; deletes one; puts another chunk's (another codec's)
parameters in place; or renames the chunk's codec.

Each result is read as `inspect --stats`, `verify` and `dump` read it, without the CLI: the
manifest parsed, every check of `verify` (`check_file`), every chunk decoded and its payload's
statistics taken. The contract: it reads, or raises a `KvtoolError` (one line at the CLI); never
another exception, never a hang (-timeout), never an allocation past -rss_limit_mb.

    python fuzz/fuzz_codec_params.py -runs=200000 -rss_limit_mb=2048 -timeout=10 WORKDIR/corpus
    python fuzz/fuzz_codec_params.py -max_total_time=20 ...   (CI: tests/test_fuzz_codec_params.py)

Inputs that once failed are kept in fuzz/regressions/codec_params/ (CI runs them first, every time).

pca's calibration is the test vectors' (format-spec/vectors/pca: 2 layers, one KV head of 8), found
through KVTOOL_CALIBRATION_PATH, which this script sets when it is unset.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import atheris

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO / "format-spec" / "vectors" / "pca"
os.environ.setdefault("KVTOOL_CALIBRATION_PATH", str(VECTORS))

with atheris.instrument_imports(include=["kvtool"]):
    import torch

    import kvtool.codecs.cachegen  # noqa: F401  (the codecs load on first use: instrumented here)
    import kvtool.codecs.pca  # noqa: F401
    import kvtool.codecs.raw  # noqa: F401
    import kvtool.codecs.zstd  # noqa: F401
    from kvtool import codecs
    from kvtool.errors import KvtoolError
    from kvtool.format import ContainerReader, ContainerWriter
    from kvtool.format.hashing import crc32
    from kvtool.format.layout import TRAILER_SIZE, TRAILER_STRUCT
    from kvtool.format.reader import BytesSource
    from kvtool.identity import ModelIdentity
    from kvtool.ops.verify import check_file

L, H, D, T, CHUNK = 2, 1, 8, 16, 4
IDENTITY = ModelIdentity(name="fuzz", architecture="LlamaForCausalLM", num_layers=L, num_attention_heads=2 * H,
                         num_kv_heads=H, head_dim=D, hidden_size=2 * H * D, intermediate_size=4 * H * D,
                         vocab_size=1000, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope={"rope_theta": 10000.0, "rope_scaling": None})
CALIBRATION = json.loads((VECTORS / "bf16_sinks.json").read_text())["params"]["calibration"]  # L = 2, C = 8
PARAMS = {  # each codec's parameters as a writer records them
    "raw": {"version": 1},
    "zstd": {"version": 1, "level": 3, "shuffle": "byteplane"},
    "cachegen": {"version": 1, "bins": "default", "prob_bits": 14, "lanes": 4},
    "pca": {"version": 1, "calibration": CALIBRATION, "quality": "97", "step": 0.8, "sinks": 4, "lanes": 16},
}
CODEC_IDS = {name: codecs.get_codec(name).codec_id for name in PARAMS}
KEYS = sorted({k for p in PARAMS.values() for k in p} | {"position", "colour", ""})
EDGE = [[], {}, None, -1, 0, 1, 2, 63, 64, 65, -(2 ** 63), 2 ** 63, 2 ** 64, 10 ** 39, -10 ** 39, 1.5, -0.0,
        1e-300, 1e308, 2.0 ** -11, 2.0 ** 10, "NaN", "nan", "Infinity", "-inf", True, False, "", "default",
        "99", "97", "k:0-1=32;v:0-=16", "none", "byteplane", "\x1b[2J\x1b]0;x\x07", "a" * 64, "0" * 64, CALIBRATION,
        [1, 2], [[[]]], {"version": 1}, 2 ** 20, 2 ** 40, 2 ** 40 + 1, 4, 8, 12, 16]


def base_files() -> list[bytes]:
    """One file per codec and one mixing all four, chunk by chunk (bf16, 4 chunks of 4 tokens)."""
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(2, L, T, H * D, generator=g) * 2).to(torch.bfloat16)
    tokens = list(range(100, 100 + T))
    plans = [[name] * (T // CHUNK) for name in PARAMS] + [list(PARAMS)]
    files = []
    for plan in plans:
        writer = ContainerWriter(None, IDENTITY, tokens, kv_dtype=torch.bfloat16, chunk_size=CHUNK)
        for i, (start, end) in enumerate(writer.chunk_ranges()):
            writer.write_chunk(kv[:, :, start:end], plan[i], dict(PARAMS[plan[i]]))
        writer.finish()
        files.append(writer.getvalue())
    return files


BASES = base_files()
MANIFESTS = []
for _data in BASES:
    _offset, _length = TRAILER_STRUCT.unpack(_data[-TRAILER_SIZE:])[:2]
    MANIFESTS.append((_data[:_offset], json.loads(_data[_offset:_offset + _length])))
ALL_PARAMS = [c["codec_params"] for _, doc in MANIFESTS for c in doc["chunks"]]


def a_value(fdp: atheris.FuzzedDataProvider):
    """An edge value of the table, or one the fuzzer makes, of any JSON type."""
    kind = fdp.ConsumeIntInRange(0, 6)
    if kind == 0:
        return fdp.ConsumeInt(9)  # signed, up to 2^71
    if kind == 1:
        return fdp.ConsumeRegularFloat()
    if kind == 2:
        return fdp.ConsumeUnicodeNoSurrogates(80)
    if kind == 3:
        return [a_value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 2))] if fdp.remaining_bytes() else []
    if kind == 4:
        return {fdp.ConsumeUnicodeNoSurrogates(8): fdp.ConsumeInt(2)}
    # a copy: the table's lists and objects are shared, and an edit that put one inside itself (or
    # into the next input) would make a cycle json.dumps refuses: a fault of this script, not kvtool's
    return copy.deepcopy(EDGE[fdp.ConsumeIntInRange(0, len(EDGE) - 1)])


def edit(doc: dict, fdp: atheris.FuzzedDataProvider) -> None:
    chunk = doc["chunks"][fdp.ConsumeIntInRange(0, len(doc["chunks"]) - 1)]
    op = fdp.ConsumeIntInRange(0, 5)
    params = chunk["codec_params"]
    if not isinstance(params, dict):  # an earlier edit made it another type: edit an object again
        params = chunk["codec_params"] = {}
    if op in (0, 1):  # a key the codecs define (or an unknown one) set to a value
        params[KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)]] = a_value(fdp)
    elif op == 2 and params:
        params.pop(sorted(params)[fdp.ConsumeIntInRange(0, len(params) - 1)])
    elif op == 3:  # another chunk's parameters, of this codec or another
        chunk["codec_params"] = json.loads(json.dumps(ALL_PARAMS[fdp.ConsumeIntInRange(0, len(ALL_PARAMS) - 1)]))
    elif op == 4:  # the chunk renamed to another codec, its name and id agreeing, its parameters kept
        name = list(PARAMS)[fdp.ConsumeIntInRange(0, len(PARAMS) - 1)]
        chunk["codec"], chunk["codec_id"] = name, CODEC_IDS[name]
    else:  # the whole parameters replaced by a value of any type
        chunk["codec_params"] = a_value(fdp)


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    body, doc = MANIFESTS[fdp.ConsumeIntInRange(0, len(MANIFESTS) - 1)]
    doc = json.loads(json.dumps(doc))
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        edit(doc, fdp)
    manifest = json.dumps(doc, separators=(",", ":")).encode()  # NaN/Infinity floats: ManifestCorrupt
    trailer = TRAILER_STRUCT.unpack(BASES[0][-TRAILER_SIZE:])
    read(body + manifest + TRAILER_STRUCT.pack(len(body), len(manifest), crc32(manifest), trailer[3], trailer[4]))


def read(data: bytes) -> None:
    try:
        with ContainerReader(BytesSource(data, "fuzz.kvc")) as reader:
            check_file(reader)  # verify's checks: structure, CRCs, decoding, finiteness, hashes, padding
            for c in reader.chunks:  # dump's decode, inspect --stats's breakdown
                codec = codecs.get_codec(c.codec_id)
                payload = reader.chunk_payload(c.index)
                reader.decode_chunk_array(c.index, payload)
                codec.payload_stats(payload, c.shape, c.codec_params)
    except KvtoolError:
        pass  # a refusal, in one line: what the contract asks


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
