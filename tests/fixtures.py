"""Shared helpers for the container and CLI tests (not a conftest: import what you need).

- `make_identity` / `write_kv_file`: a small synthetic model identity and a KV file
  written by the real `ContainerWriter`, with the tensors it was built from.
- `split_file` / `rebuild`: take a valid file apart (header, data region, manifest,
  trailer) and put it back together with a modified manifest, recomputing the
  manifest CRC-32 and the trailer, so a hostile-input test hits exactly one check.
- `ref_prefix_hashes` / `ref_crc32`: independent re-implementations of the
  documented hash definitions (not kvtool's own code).
- `put` / `mutated` / `flip_byte` / `chunk_entry`: small helpers the hostile-input tests
  (test_bad_input.py, test_fuzz_container.py) share; the valid files they start from are the
  `raw_file` and `zstd_file` fixtures in conftest.py.
- `time_limit`: fail a test instead of hanging forever.
- `save_tiny_model`: a tiny random transformers model with a byte-level tokenizer, saved in a
  folder that kvtool's engine and transformers both load in a second.
"""

from __future__ import annotations

import contextlib
import math
import copy
import hashlib
import json
import os
import signal
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity

# Spelled out here (not imported from kvtool.format.layout) so a change to the
# layout module cannot silently change what the tests expect.
MAGIC = b"\x89KVC\r\n\x1a\n"
END_MAGIC = b"\x89KVCEND\n"
HEADER_SIZE = 64
TRAILER_SIZE = 32
HEADER_FMT = "<8sHHIII40s"
TRAILER_FMT = "<QQII8s"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --- reference definitions ------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # reflected Castagnoli polynomial
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def ref_crc32(data: bytes) -> int:
    """The spec's checksum, CRC-32C (Castagnoli), bit by bit from its definition."""
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def ref_prefix_hashes(token_ids, chunk_size: int) -> list[str]:
    """SHA-256 chained from 32 zero bytes over each chunk's token ids as u32 little-endian."""
    ids = [int(t) for t in token_ids]
    out, prev = [], bytes(32)
    for start in range(0, len(ids), chunk_size):
        part = ids[start:start + chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(part)}I", *part)).digest()
        out.append(prev.hex())
    return out


# --- synthetic files -------------------------------------------------------------


def make_identity(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8,
                  name: str = "synthetic-tiny") -> ModelIdentity:
    return ModelIdentity(
        name=name, architecture="LlamaForCausalLM", num_layers=num_layers,
        num_attention_heads=num_kv_heads * 2, num_kv_heads=num_kv_heads, head_dim=head_dim,
        hidden_size=num_kv_heads * 2 * head_dim, intermediate_size=4 * num_kv_heads * head_dim,
        vocab_size=1000, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope={"rope_theta": 10000.0, "rope_scaling": None})


def make_kv(identity: ModelIdentity, num_tokens: int, dtype: torch.dtype = torch.bfloat16,
            seed: int = 0) -> torch.Tensor:
    """A KV_BLOB [2, L, T, H*D] of random values, with a few outliers and special values."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, identity.num_layers, num_tokens, identity.num_kv_heads * identity.head_dim,
                     generator=g) * 3
    kv[..., 0] *= 40  # an outlier channel, like real K caches have
    flat = kv.view(-1)
    flat[:: 7] = 0.0
    flat[1:: 11] = -0.0
    return kv.to(dtype)


@dataclass
class KvFile:
    path: Path
    identity: ModelIdentity
    kv: torch.Tensor  # the full KV_BLOB [2, L, T, C] written (in the file's dtype)
    token_ids: list[int]
    chunk_size: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def chunk(self, i: int) -> torch.Tensor:
        return self.kv[:, :, i * self.chunk_size:(i + 1) * self.chunk_size]


def write_kv_file(path, *, identity: ModelIdentity | None = None, num_tokens: int = 10,
                  chunk_size: int = 4, dtype: torch.dtype = torch.bfloat16, codec: str = "raw",
                  params: dict[str, Any] | None = None, alignment: int = 64,
                  extras: bool = False, seed: int = 0, token_ids=None,
                  kv: torch.Tensor | None = None,
                  codecs_per_chunk: list[tuple[str, dict | None]] | None = None) -> KvFile:
    identity = identity or make_identity()
    if kv is None:
        kv = make_kv(identity, num_tokens, dtype, seed)
    if token_ids is None:
        token_ids = [(seed * 7919 + 31 * i + 5) % 50_000 for i in range(num_tokens)]
    token_ids = [int(t) for t in token_ids]
    ex: dict[str, torch.Tensor] = {}
    if extras:
        g = torch.Generator().manual_seed(seed + 1)
        ex["hidden_states"] = torch.randn(num_tokens, identity.hidden_size, generator=g).to(dtype)
        ex["roi_mask"] = torch.rand(num_tokens, generator=g) > 0.5
    with ContainerWriter(path, identity, token_ids, kv_dtype=dtype, chunk_size=chunk_size,
                         alignment=alignment) as w:
        for i, (s, e) in enumerate(w.chunk_ranges()):
            c, p = codecs_per_chunk[i % len(codecs_per_chunk)] if codecs_per_chunk else (codec, params)
            w.write_chunk(kv[:, :, s:e], c, p)
        for name, t in ex.items():
            w.write_extra(name, t)
    return KvFile(Path(path), identity, kv, token_ids, chunk_size, ex)


def read_everything(path) -> dict[str, Any]:
    """Open a file and decode everything in it (raises whatever the reader raises)."""
    with ContainerReader(path) as r:
        return {"tokens": r.token_ids().tolist(),
                "chunks": [r.read_chunk(i) for i in range(len(r.chunks))],
                "extras": {name: r.read_extra(name) for name in r.manifest.extras}}


def kv_relative_error(path, reference) -> float:
    """Largest |KV - reference KV| of two files of the same tokens, relative to the largest
    reference magnitude of its layer (how two runs of one model, or a lossy file and its
    original, are compared)."""
    with ContainerReader(path) as r, ContainerReader(reference) as ref:
        assert r.token_ids().tolist() == ref.token_ids().tolist()
        got, want = r.read_range(0, r.num_tokens).float(), ref.read_range(0, ref.num_tokens).float()
    scale = want.abs().amax(dim=(0, 2, 3), keepdim=True)  # [1, L, 1, 1]
    return float(((got - want).abs() / scale).max())


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads, -0.0 and all)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["tokens"] == b["tokens"] and len(a["chunks"]) == len(b["chunks"])
            and all(same_tensor(x, y) for x, y in zip(a["chunks"], b["chunks"]))
            and a["extras"].keys() == b["extras"].keys()
            and all(same_tensor(a["extras"][k], b["extras"][k]) for k in a["extras"]))


# --- taking files apart and putting them back together ---------------------------------


@dataclass
class Parts:
    header: bytes  # 64 bytes
    data: bytes  # header + blobs + padding, up to the manifest offset
    manifest_raw: bytes
    manifest: dict[str, Any]
    trailer: tuple  # (offset, length, crc, reserved, end_magic)

    @property
    def manifest_offset(self) -> int:
        return len(self.data)


def split_file(source) -> Parts:
    blob = Path(source).read_bytes() if isinstance(source, (str, os.PathLike)) else bytes(source)
    trailer = struct.unpack(TRAILER_FMT, blob[-TRAILER_SIZE:])
    offset, length = trailer[0], trailer[1]
    raw = blob[offset:offset + length]
    return Parts(blob[:HEADER_SIZE], blob[:offset], raw, json.loads(raw), trailer)


def rebuild(source, mutate: Callable[[dict], Any] | None = None, *,
            manifest: dict | None = None, manifest_raw: bytes | None = None,
            data: bytes | None = None, crc: int | None = None, reserved: int = 0,
            end_magic: bytes = END_MAGIC, header: bytes | None = None) -> bytes:
    """Re-assemble `source` (a path or bytes) with a new manifest and a consistent trailer.

    `mutate(doc)` edits a deep copy of the manifest dict in place; or pass the whole
    `manifest` dict, or `manifest_raw` bytes. `data` replaces the data region (same
    length or not: the manifest moves, 8-aligned, after it). `header` replaces the
    first 64 bytes; `crc`, `reserved` and `end_magic` override trailer fields.
    """
    parts = split_file(source)
    body = bytearray(parts.data if data is None else data)
    if header is not None:
        body[:HEADER_SIZE] = header
    if manifest_raw is None:
        doc = copy.deepcopy(parts.manifest if manifest is None else manifest)
        if mutate is not None:
            mutate(doc)
        manifest_raw = json.dumps(doc, separators=(",", ":")).encode()
    body += bytes(-len(body) % 8)
    offset = len(body)
    trailer = struct.pack(TRAILER_FMT, offset, len(manifest_raw),
                          ref_crc32(manifest_raw) if crc is None else crc, reserved, end_magic)
    return bytes(body) + manifest_raw + trailer


def patch_blob(source, blob_ref: dict[str, Any], new_payload: bytes, *, fix_crc: bool = True,
               mutate: Callable[[dict], Any] | None = None) -> bytes:
    """Overwrite the bytes of one blob in place (length may shrink, never grow past the
    next blob), update that blob's manifest entry (length, and crc32 if `fix_crc`)."""
    parts = split_file(source)
    data = bytearray(parts.data)
    off = blob_ref["offset"]
    data[off:off + len(new_payload)] = new_payload
    assert len(data) == len(parts.data), "patched payload ran past the data region"

    def edit(doc):
        for entry in _blob_entries(doc):
            if entry["offset"] == off:
                entry["length"] = len(new_payload)
                if fix_crc:
                    entry["crc32"] = ref_crc32(new_payload)
        if mutate is not None:
            mutate(doc)
    return rebuild(source, edit, data=bytes(data))


def _blob_entries(doc: dict) -> list[dict]:
    return [doc["sequence"]["tokens"], *doc["chunks"], *doc.get("extras", {}).values()]


def blob_bytes(source, ref: dict[str, Any]) -> bytes:
    blob = Path(source).read_bytes() if isinstance(source, (str, os.PathLike)) else bytes(source)
    return blob[ref["offset"]:ref["offset"] + ref["length"]]


def pack_header(*, magic: bytes = MAGIC, major: int = 1, minor: int = 0, header_size: int = 64,
                alignment: int = 64, flags: int = 0, reserved: bytes = bytes(40)) -> bytes:
    return struct.pack(HEADER_FMT, magic, major, minor, header_size, alignment, flags, reserved)


# --- helpers for hostile-input tests -----------------------------------------------------


def put(tmp_path, data: bytes, name: str = "bad.kvc") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def mutated(kv_file: KvFile, mutate) -> bytes:
    return rebuild(kv_file.path, mutate)


def flip_byte(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


def chunk_entry(kv_file: KvFile, i: int = 0) -> dict[str, Any]:
    """The manifest entry of chunk `i` (offset, length, crc32, codec, ...)."""
    return split_file(kv_file.path).manifest["chunks"][i]


# --- guard against hangs ----------------------------------------------------------------


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError if the block runs longer than `seconds` (main thread, POSIX)."""
    if not hasattr(signal, "setitimer"):  # pragma: no cover
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s (a hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def raw_source(shape, dtype, *, data=None, fd: int = -1, offset: int = 0, crc: int, what: str = "chunk",
               mapped: bool = False):
    """A raw stored chunk (`kvtool.chunk_source.ChunkSource`) of KV `shape`/`dtype`, not checked yet:
    its bytes in memory or a mapping (`data`), or in the open file `fd` at `offset` (owned: released
    closes it)."""
    from kvtool.chunk_source import ChunkSource
    from kvtool.dtypes import dtype_name

    length = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()

    def decode(payload, device):
        return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape).to(device or "cpu")

    return ChunkSource(what=what, codec="raw", dtype=dtype_name(dtype), shape=tuple(shape), length=length,
                       crc32c=crc, raw=True, decode=decode, data=None if data is None else memoryview(data).cast("B"),
                       fd=fd, offset=offset, mapped=mapped)


def cli(capsys, *argv) -> tuple[int, "dict | str", str]:
    """`kvtool ARGV...` in this process: (exit code, stdout (parsed when --json), stderr)."""
    from kvtool.cli.app import run

    capsys.readouterr()  # drop what earlier, uncaptured calls printed
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    if "--json" in argv and out.strip():
        return code, json.loads(out), err
    return code, out, err


def learn_calibration(model, folder: Path, tokens: int = 640) -> str:
    """The pca codec's calibration object of a loaded model (`kvtool.load_model`), learned as
    `kvtool calibrate` learns it but on `tokens` tokens of Python's documentation (seconds, not a
    minute: the codec's behaviour does not depend on how much text the basis saw), saved in
    `folder` and registered there as the model's (what $KVTOOL_CALIBRATION_DIR=folder then finds).
    Returns its digest."""
    from pydoc_data.topics import topics

    from kvtool.codecs.pca import calibration as calmod
    from kvtool.ops.calibrate import calibrate

    ids = model.tokenizer.encode(topics["numbers"] + topics["exceptions"], add_special_tokens=False)[:tokens]
    # without the rows' gains (a minute of model runs each time): chunks, stores and engines
    # treat a calibration the same either way; test_pca_model's `kvtool calibrate` learns them
    cal = calibrate(model, [ids], gains=False).save(folder)
    previous = os.environ.get("KVTOOL_CALIBRATION_DIR")
    os.environ["KVTOOL_CALIBRATION_DIR"] = str(folder)
    try:
        calmod.register(model.identity.fingerprint(), cal.digest)
    finally:
        if previous is None:
            del os.environ["KVTOOL_CALIBRATION_DIR"]
        else:
            os.environ["KVTOOL_CALIBRATION_DIR"] = previous
    return cal.digest


# --- tiny random models ---------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **config) -> Path:
    """A tiny random decoder (hidden 64, 2 layers, vocabulary 256) saved with save_pretrained, with
    a byte-level tokenizer (one token per byte, no special tokens) and a chat template: loaded by
    kvtool's engine and by transformers in a second, where a test needs a model but not its skill."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, **config)
    make = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config}[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make(**common))
    with torch.no_grad():  # biases too (they start at zero), so Qwen2's q/k/v biases matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    alphabet = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder
