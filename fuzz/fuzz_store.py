"""A standing coverage-guided fuzzer of the chunk store's readers (atheris, libFuzzer's engine).

Every input is one chunk object's bytes followed by 4 bytes that say where to cut it. Three readers
take it, each the way the store reads objects (format-spec/store.md §5):

  * from memory (a Redis or memory-tier object): every check, then `store get`'s values check
    and a load into paged buffers through the one load path;
  * from a real file, opened as the folder backend opens objects (`PreadFile`), the file then cut
    short at the input's cut point *after* it was opened and its header read, as another program
    truncating a shared store's object would (the load reads the payload after the cut);
  * `fsck`'s check of the object under its name.

The contract: each either accepts the object (and then its values are finite and the load writes
exactly its KV) or refuses it with a `KvtoolError`, one line; never another exception, never a
hang (libFuzzer's -timeout), never an allocation past -rss_limit_mb, never a signal.

    python fuzz/fuzz_store.py -runs=100000 -rss_limit_mb=2048 -timeout=10 WORKDIR/corpus
    python fuzz/fuzz_store.py -max_total_time=30 ...       (CI: tests/test_fuzz_standing.py)

With an empty corpus folder it first writes its seeds there: valid objects of every codec and
three KV dtypes, one holding NaN (refused by check 13), each with cut points none, mid-payload and
mid-manifest.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["kvtool"]):
    import torch

    from kvtool.connectors import ConnectorTarget, PagedMemConnectorV2
    from kvtool.errors import KvtoolError
    from kvtool.format.reader import PreadFile
    from kvtool.identity import ModelIdentity
    from kvtool.load import ChunkTask, load
    from kvtool.store import objects
    from kvtool.format.hashing import ZERO_HASH
    from kvtool.store.names import chunk_name, model_key
    from kvtool.store.upkeep import check_object

L, H, D, S = 2, 2, 8, 8
IDENTITY = ModelIdentity(name="fuzz", architecture="LlamaForCausalLM", num_layers=L, num_attention_heads=2 * H,
                         num_kv_heads=H, head_dim=D, hidden_size=2 * H * D, intermediate_size=4 * H * D,
                         vocab_size=1000, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope={"rope_theta": 10000.0, "rope_scaling": None})
MODEL = {**IDENTITY.to_dict(), "fingerprint": IDENTITY.fingerprint()}
TOKENS = list(range(40, 40 + S))
SCRATCH = tempfile.mkdtemp(prefix="kvtool-fuzz-store-")


def seeds() -> list[bytes]:
    out = []
    for codec in ("raw", "zstd", "cachegen"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            kv = torch.randn(2, L, S, H * D, generator=torch.Generator().manual_seed(7)).to(dtype)
            name = str(dtype).removeprefix("torch.")
            obj = objects.encode_chunk(MODEL, name, ZERO_HASH, 0, TOKENS, kv=kv, codec=codec)
            for cut in (0, len(obj) // 2, len(obj) - 40):
                out.append(obj + struct.pack("<I", cut))
    kv = torch.randn(2, L, S, H * D)
    kv[1, 1, 3, 5] = float("nan")
    out.append(objects.encode_chunk(MODEL, "float32", ZERO_HASH, 0, TOKENS, kv=kv) + struct.pack("<I", 0))
    return out


def _name() -> str:
    from kvtool.store.names import link_hash

    return chunk_name(model_key(MODEL), S, link_hash(ZERO_HASH, TOKENS, None).hex())


NAME = None  # set in main (after the imports are instrumented)


def target():
    caches = [torch.zeros(2, 4, 4, H, D) for _ in range(L)]
    connector = PagedMemConnectorV2(H * D, L, layout="flash_attn", num_kv_heads=H, head_dim=D)
    return ConnectorTarget(connector, kvcaches=caches, slot_mapping=torch.arange(S)), connector, caches


def loaded_from(data) -> None:
    """The object checked as a load checks it, then loaded into paged buffers; an accepted load
    left exactly the decoded KV, every value finite."""
    obj = objects.check_chunk(data, "fuzz", verify_payload=False)
    if obj.reader.manifest.num_tokens != S or obj.reader.chunks[0].shape != (2, L, S, H * D):
        obj.reader.close()
        return  # another geometry: checked, not loadable into these buffers
    destination, connector, caches = target()
    outcome = load([ChunkTask(0, S, obj.source)], destination)
    if outcome.error is not None:
        raise outcome.error
    out = connector.allocate(S, caches[0].dtype)
    connector.from_gpu(out, 0, S, kvcaches=caches, slot_mapping=torch.arange(S))
    assert bool(torch.isfinite(out.tensor).all()), "a load accepted values that are not finite"


def from_memory(data: bytes) -> None:
    try:
        objects.check_chunk(data, "fuzz").check_values()
        loaded_from(data)
    except KvtoolError:
        pass


def from_a_file_cut_short(data: bytes, cut: int) -> None:
    path = os.path.join(SCRATCH, "object.kvc")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = PreadFile(fd, "fuzz")
        try:
            obj = objects.check_chunk(source, "fuzz", verify_payload=False)  # header, manifest, tokens read
        except KvtoolError:
            return
        if cut:
            os.truncate(path, min(cut, len(data)))  # another program cuts the object short meanwhile
        try:
            if obj.reader.chunks[0].shape == (2, L, S, H * D) and obj.reader.manifest.num_tokens == S:
                destination, _, _ = target()
                outcome = load([ChunkTask(0, S, obj.source)], destination)
                if outcome.error is not None:
                    raise outcome.error
            else:
                obj.check_values()
        except KvtoolError:
            pass
        finally:
            obj.reader.close()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def with_manifest_crc_fixed(data: bytes) -> bytes | None:
    """The object with its trailer's manifest CRC made right (as fuzz_reader.py does), so that
    mutations of the manifest reach the store's checks behind it instead of stopping there."""
    from kvtool.format.hashing import crc32
    from kvtool.format.layout import TRAILER_SIZE, TRAILER_STRUCT

    if len(data) < TRAILER_SIZE:
        return None
    offset, length, _, reserved, magic = TRAILER_STRUCT.unpack(data[-TRAILER_SIZE:])
    if offset + length > len(data) - TRAILER_SIZE:
        return None
    return data[:-TRAILER_SIZE] + TRAILER_STRUCT.pack(offset, length, crc32(data[offset:offset + length]), reserved,
                                                      magic)


def one_input(data: bytes) -> None:
    if len(data) < 4:
        return
    body, cut = data[:-4], struct.unpack("<I", data[-4:])[0]
    from_memory(body)
    fixed = with_manifest_crc_fixed(body)
    if fixed is not None and fixed != body:
        from_memory(fixed)
    from_a_file_cut_short(body, cut % (len(body) + 1))
    try:
        check_object(NAME, body)  # fsck's checks, under a chunk's name (the seeds' own)
    except KvtoolError:
        pass


def main() -> None:
    global NAME
    NAME = _name()
    from corpus import seed_empty_corpus  # (fuzz/, this script's folder)

    seed_empty_corpus(seeds())
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
