"""kvtool.load: the one load path (chunks read, checked, decoded on worker threads and scattered
into paged buffers), from files and from the chunk store."""

from __future__ import annotations

import pytest
import torch

from fixtures import make_identity, make_kv, write_kv_file
from kvtool.chunk_source import ChunkSource
from kvtool.connectors import ConnectorTarget, PagedMemConnectorV2
from kvtool.errors import ChecksumMismatch, DecodeError
from kvtool.format import ContainerReader
from kvtool.load import ChunkTask, Destination, file_tasks, load, load_chunks

L, H, D, BS = 2, 2, 8, 4


def paged_target(num_tokens: int, seed: int = 0, checking: bool = True):
    """Zeroed flash_attn buffers, a shuffled slot mapping and a destination over them (`checking`:
    raw chunks copied straight from their stored bytes, checked as copied; else decoded first)."""
    num_blocks = num_tokens // BS + 2
    caches = [torch.zeros(2, num_blocks, BS, H, D) for _ in range(L)]
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    t = torch.arange(num_tokens)
    slots = blocks[t // BS] * BS + t % BS
    connector = PagedMemConnectorV2(H * D, L, layout="flash_attn", num_kv_heads=H, head_dim=D)
    target = ConnectorTarget(connector, kvcaches=caches, slot_mapping=slots)
    if not checking:  # a destination that takes decoded KV only: raw chunks copied and checked first
        target = _DecodedOnly(target)

    def read(start, end):
        out = connector.allocate(end - start, torch.float32)
        connector.from_gpu(out, start, end, kvcaches=caches, slot_mapping=slots)
        return out.tensor

    return target, read


class _DecodedOnly(Destination):
    """A destination that takes decoded KV only (`Destination`'s defaults): the load decodes every
    chunk (checked first)."""

    def __init__(self, target):
        self.device, self.target = target.device, target

    def scatter(self, kv, start, end):
        self.target.scatter(kv, start, end)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_first_failure_ends_the_load_and_earlier_chunks_stay(threads):
    kv = torch.randn(2, L, 40, H * D)
    scatter, read = paged_target(40)

    def ok(i):
        return lambda: ChunkSource.from_tensor(kv[:, :, 8 * i:8 * i + 8])

    def bad():
        raise DecodeError("chunk 2: broken on purpose")

    tasks = [ChunkTask(8 * i, 8 * i + 8, bad if i == 2 else ok(i)) for i in range(5)]
    outcome = load_chunks(tasks, scatter, threads=threads)
    assert (outcome.loaded_tokens, outcome.chunks, outcome.failed) == (16, 2, 2)
    assert isinstance(outcome.error, DecodeError)
    assert torch.equal(read(0, 16), kv[:, :, :16])


def test_a_bug_is_raised_never_reported_as_bad_input():
    def bug():
        raise RuntimeError("not a KvtoolError")

    for threads in (1, 2):
        with pytest.raises(RuntimeError):
            load_chunks([ChunkTask(0, 4, bug)], paged_target(4)[0], threads=threads)


def test_tokens_inside_a_chunk_start_where_asked():
    kv = torch.randn(2, L, 16, H * D)
    scatter, read = paged_target(16)
    outcome = load_chunks([ChunkTask(5, 16, lambda: ChunkSource.from_tensor(kv), origin=0)], scatter)
    assert outcome.loaded_tokens == 16
    assert torch.equal(read(5, 16), kv[:, :, 5:])
    assert not read(0, 5).any()  # the engine's own tokens are not written


@pytest.mark.parametrize("checking", [False, True])
@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
@pytest.mark.parametrize("num_tokens", [37, 40])
def test_a_file_loads_into_paged_buffers_as_it_reads(tmp_path, codec, num_tokens, checking):
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=45, chunk_size=8, codec=codec,
                      dtype=torch.float32)
    scatter, read = paged_target(num_tokens, checking=checking)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, num_tokens)
        assert len(tasks) == (num_tokens + 7) // 8
        outcome = load_chunks(tasks, scatter, threads=3)
        assert outcome.error is None and outcome.loaded_tokens == num_tokens
        assert torch.equal(read(0, num_tokens), reader.read_range(0, num_tokens))


# How a load runs: the pipeline with a destination that takes decoded KV only ("checked first"),
# with one that copies raw chunks from their stored bytes checking as it copies ("checked as
# copied"; "torch": without the native copy, so the payload is copied privately and checked
# first), and the staged path in its CPU mode, its pinned buffers filled by the native one-pass
# checked copy or (no native module) a copy and a CRC pass.
LOAD_PATHS = ["checked first", "checked as copied", "torch", "staged native", "staged torch"]


def load_path(path: str, monkeypatch):
    """(destination-checking flag, whether the staged path runs) for one of LOAD_PATHS."""
    if path in ("torch", "staged torch"):
        monkeypatch.setenv("KVTOOL_PAGED_NATIVE", "0")
    return path != "checked first", path.startswith("staged")


def staged_on_cpu(target, monkeypatch):
    """`target` loaded by `kvtool.load.load` as a GPU's would be: through the staged path, which
    runs on the CPU with ordinary buffers (the same steps, order and failure rule)."""
    from kvtool.load import load_chunks_staged
    from kvtool.load import path as load_module

    real = load_module.load

    def load(tasks, destination, **kwargs):
        if getattr(destination, "staged_on_cpu", False):
            return load_chunks_staged(tasks, destination, "cpu")
        return real(tasks, destination, **kwargs)

    monkeypatch.setattr("kvtool.load.load", load)
    target.staged_on_cpu = True
    return target


def flip_payload_byte(path, chunk: int, at: int, bit: int) -> None:
    """Damage one byte of chunk `chunk`'s stored payload in the file at `path` (its CRC then fails)."""
    with ContainerReader(path) as reader:
        offset = reader.chunks[chunk].blob.offset
    data = bytearray(path.read_bytes())
    data[offset + at] ^= bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("path", LOAD_PATHS)
def test_a_damaged_chunk_of_a_file_stops_the_load_there(tmp_path, path, monkeypatch):
    from kvtool.load import load_chunks_staged

    checking, staged = load_path(path, monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=48, chunk_size=8, dtype=torch.float32)
    flip_payload_byte(f.path, 3, 1, 0x08)
    scatter, read = paged_target(48, checking=checking)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, 48)
        outcome = load_chunks_staged(tasks, scatter, "cpu") if staged else load_chunks(tasks, scatter, threads=2)
    assert isinstance(outcome.error, ChecksumMismatch) and "chunk 3" in str(outcome.error)
    assert outcome.loaded_tokens == 24 and outcome.chunks == 3
    assert torch.equal(read(0, 24), f.kv[:, :, :24])
    if staged:  # the staged path scatters in order: nothing past the failure
        assert not read(24, 48).any()


@pytest.mark.parametrize("path", LOAD_PATHS)
def test_the_store_loads_from_a_token_on_and_refuses_damage(tmp_path, path, monkeypatch):
    from kvtool.store import open_store

    checking, staged = load_path(path, monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(100, 140))
    kv = make_kv(identity, 40, torch.float32)
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=8)
    cache.put_sequence(tokens, kv)
    scatter, read = paged_target(40, checking=checking)
    if staged:
        scatter = staged_on_cpu(scatter, monkeypatch)
    hit = cache.load_prefix(tokens, scatter, from_token=12)
    assert hit.num_tokens == 40 and hit.codecs == ["raw"] * 4 and not hit.refused
    assert torch.equal(read(12, 40), kv[:, :, 12:40]) and not read(0, 12).any()
    third = cache._chain(tokens)[2].prefix_hash
    flip_payload_byte(next((tmp_path / "store").glob(f"chunks/**/{third}.kvc")), 0, 5, 0x01)
    scatter, read = paged_target(40, seed=1, checking=checking)
    if staged:
        scatter = staged_on_cpu(scatter, monkeypatch)
    hit = cache.load_prefix(tokens, scatter)
    assert hit.num_tokens == 16 and len(hit.refused) == 1
    assert torch.equal(read(0, 16), kv[:, :, :16])
    assert "CRC-32C" in hit.refused[0] and cache.store.counters.refused == 1
    if staged:
        assert not read(16, 40).any()


def test_the_store_reads_raw_payloads_as_it_scatters_them_and_refuses_one_cut_short_meanwhile(tmp_path, monkeypatch):
    """A local store's raw objects are opened, not read whole: the checked scatter reads their
    payloads (mapped behind a fault guard, or a window at a time; never into the buffer), every
    descriptor is closed after, and an object truncated by someone else between its checks and its
    scatter is refused there."""
    import os

    from kvtool.connectors import paged_native
    from kvtool.store import objects, open_store

    if paged_native.native_module() is None:
        pytest.skip("kvtool._paged_native is not built")
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(200, 240))
    kv = make_kv(identity, 40, torch.float32)
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=8)
    cache.put_sequence(tokens, kv)
    store_dir = str((tmp_path / "store").resolve())

    def open_in_store() -> list[str]:  # this process's descriptors on files of the store
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # (the listing's own descriptor, closed by now)
                pass
        return [path for path in held if path.startswith(store_dir + "/chunks")]

    made, real = [], objects.ChunkObject.source

    def spy(self):
        source = real(self)
        made.append(source)
        if self.start == 16 and cut_short:  # someone truncates the third object meanwhile
            os.truncate(next((tmp_path / "store").glob(f"chunks/**/{self.prefix_hash}.kvc")),
                        source.offset + source.length - 5)
        return source

    monkeypatch.setattr(objects.ChunkObject, "source", spy)
    native = paged_native.native_module()
    threshold = native.map_min_bytes(0)
    try:
        for seed, mapped in enumerate((True, False)):  # mapped, then read a window at a time
            native.map_min_bytes(0 if mapped else 1 << 62)
            made.clear()
            cut_short = False
            scatter, read = paged_target(40, seed=seed, checking=True)
            hit = cache.load_prefix(tokens, scatter)
            assert hit.num_tokens == 40 and not hit.refused and torch.equal(read(0, 40), kv)
            assert len(made) == 5 and all(source.data is None for source in made)  # never read into memory
            assert all(source.fd == -1 for source in made)  # every descriptor closed
            assert open_in_store() == []
            cut_short = True
            scatter, read = paged_target(40, seed=seed + 2, checking=True)
            hit = cache.load_prefix(tokens, scatter)
            assert hit.num_tokens == 16 and len(hit.refused) == 1 and "ends inside the payload" in hit.refused[0]
            assert torch.equal(read(0, 16), kv[:, :, :16])
            assert open_in_store() == []
            # a refused object is removed by the load that refused it (healed): stored again whole for the next round
            assert not (tmp_path / "store").joinpath(cache.chunk_names(tokens)[2]).exists()
            assert cache.put_sequence(tokens, kv).stored == 1
    finally:
        native.map_min_bytes(threshold)


def test_a_store_object_that_cannot_be_read_is_an_error_not_damage(tmp_path):
    """A folder where an object should be (a miss; opened, refused: not an object) and an object
    whose reads fail (an InputFileError): one-line errors; a failed read says nothing about the
    stored bytes, so nothing is removed for it."""
    import os
    import shutil

    from kvtool.errors import InputFileError, ObjectRefused
    from kvtool.store import objects, open_store

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(300, 324))
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=8)
    cache.put_sequence(tokens, make_kv(identity, 24, torch.float32))
    second = cache.chunk_names(tokens)[1]
    path = tmp_path / "store" / second
    shutil.move(path, tmp_path / "kept.kvc")
    path.mkdir()
    scatter, _ = paged_target(24, checking=True)
    hit = cache.load_prefix(tokens, scatter)  # not a file: a miss there (the existence check)
    assert hit.num_tokens == 8 and not hit.refused
    with pytest.raises(ObjectRefused, match="not a regular file"):  # (made a folder after that check)
        cache.backend.open(second)
    assert cache.store.counters.refused == 0 and path.is_dir()
    path.rmdir()
    shutil.move(tmp_path / "kept.kvc", path)
    source = cache.backend.open(second)
    folder = os.open(tmp_path, os.O_RDONLY)
    os.dup2(folder, source.fd)  # its descriptor now holds a folder: every read fails (EISDIR)
    os.close(folder)
    with pytest.raises(InputFileError, match="is a directory"):
        objects.check_chunk(source, second)
    assert cache.backend.exists(second)


def test_raw_chunks_are_checked_as_they_are_scattered_not_before(tmp_path, monkeypatch):
    """A raw file's whole chunks go to the destination as sources over the mapped file and the
    native checked scatter copies them (no separate read, no separate CRC pass); a partial last
    chunk is decoded from a private, checked copy."""
    from kvtool.connectors import paged_native

    if paged_native.native_module() is None:
        pytest.skip("kvtool._paged_native is not built")
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=45, chunk_size=8, dtype=torch.float32)
    calls = {"checked": 0, "decoded": 0}
    checked, decode = paged_native.native_scatter_source, ChunkSource.decode

    def count_checked(*args):
        calls["checked"] += 1
        return checked(*args)

    def count_decode(self, *args, **kwargs):
        calls["decoded"] += 1
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(paged_native, "native_scatter_source", count_checked)
    monkeypatch.setattr(ChunkSource, "decode", count_decode)
    scatter, read = paged_target(45, checking=True)
    with ContainerReader(f.path) as reader:
        outcome = load_chunks(file_tasks(reader, 43), scatter, threads=2)
    assert outcome.error is None and outcome.loaded_tokens == 43
    assert calls == {"checked": 5, "decoded": 1}  # 5 whole chunks from the map; tokens 40..43 of the last decoded
    assert torch.equal(read(0, 43), f.kv[:, :, :43])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_file_cut_short_while_it_loads_is_refused_not_a_crash(tmp_path, threads):
    """A container file truncated by another program after it was opened: its raw chunks are
    scattered from the file's mapping, whose pages past the new end fault (SIGBUS) when the copy
    reaches them. The load stops at the first chunk cut short, with the chunks before it loaded."""
    import os

    from kvtool.connectors import paged_native

    if paged_native.native_module() is None:
        pytest.skip("kvtool._paged_native is not built")  # (the torch copy has no guard)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=512, chunk_size=128, dtype=torch.float32)
    scatter, read = paged_target(512, checking=True)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, 512)
        os.truncate(f.path, reader.chunks[1].blob.offset)  # chunks 1-3 (32 KB each) are gone
        outcome = load_chunks(tasks, scatter, threads=threads)
    assert outcome.loaded_tokens == 128 and outcome.failed == 1
    assert isinstance(outcome.error, ChecksumMismatch) and "ends inside the payload" in str(outcome.error)
    assert torch.equal(read(0, 128), f.kv[:, :, :128])


def test_unchecked_bytes_through_the_nested_connector_are_checked_as_copied():
    """As the paged connectors: the stored bytes are checked as they are copied (one read) and a
    mismatch raises after the copy; the tokens it wrote are then not reported loaded."""
    from kvtool.connectors import NestedTupleConnector

    kv = torch.randn(2, L, 8, H * D)
    source = ChunkSource.from_tensor(kv, "chunk 0")
    source.checked = False  # stored bytes, not checked yet
    caches = [(torch.zeros(8, H, D), torch.zeros(8, H, D)) for _ in range(L)]
    connector = NestedTupleConnector(H * D, L)
    connector.to_gpu_source(source, 0, 8, kvcaches=caches)
    assert torch.equal(caches[1][1], kv[1, 1].view(8, H, D))
    source.data[9] ^= 1
    fresh = [(torch.zeros(8, H, D), torch.zeros(8, H, D)) for _ in range(L)]
    with pytest.raises(ChecksumMismatch, match="chunk 0"):
        connector.to_gpu_source(source, 0, 8, kvcaches=fresh)
    wider = [(torch.zeros(8, H, D, dtype=torch.float64), torch.zeros(8, H, D, dtype=torch.float64)) for _ in range(L)]
    with pytest.raises(ChecksumMismatch, match="chunk 0"):  # converted by torch: a checked private copy first
        connector.to_gpu_source(source, 0, 8, kvcaches=wider)
    assert not any(t.any() for pair in wider for t in pair)


# --- the staged path (pinned buffers, a side stream on a GPU; on the CPU the same steps) -------

@pytest.mark.parametrize("staging", [1, 2, 3])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_the_staged_path_loads_a_file_through_reused_buffers(tmp_path, codec, staging):
    from kvtool.load import load_chunks_staged

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=45, chunk_size=8, codec=codec,
                      dtype=torch.float32)
    scatter, read = paged_target(45)
    with ContainerReader(f.path) as reader:
        outcome = load_chunks_staged(file_tasks(reader, 43), scatter, "cpu", staging=staging)
        assert outcome.error is None and outcome.loaded_tokens == 43 and outcome.chunks == 6
        assert torch.equal(read(0, 43), reader.read_range(0, 43))


def gpu_target(num_tokens: int, dtype=torch.float32, layout: str = "flash_attn"):
    """Zeroed paged buffers on the GPU, a shuffled slot mapping, a destination over them and a
    reader of what they hold (on the CPU)."""
    num_blocks = num_tokens // BS + 4
    shape = (2, num_blocks, BS, H, D) if layout == "flash_attn" else (num_blocks, 2, BS, H, D)
    caches = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(L)]
    slots = torch.randperm(num_blocks * BS, generator=torch.Generator().manual_seed(3))[:num_tokens]
    connector = PagedMemConnectorV2(H * D, L, layout=layout, num_kv_heads=H, head_dim=D, use_gpu=True)
    target = ConnectorTarget(connector, kvcaches=caches, slot_mapping=slots)
    assert target.device.type == "cuda"

    def read(start, end):
        torch.cuda.synchronize()
        out = connector.allocate(end - start, dtype)
        connector.from_gpu(out, start, end, kvcaches=caches, slot_mapping=slots)
        return out.tensor.cpu()

    return target, read


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
def test_the_load_path_on_a_gpu_gives_the_cpu_result(tmp_path, codec, dtype, layout):
    """`load` into GPU buffers (raw and zstd: the staged path; CacheGen: decoded on the GPU in
    batches) leaves exactly what the CPU decoder gives, in every layout."""
    from kvtool.load import load

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=45, chunk_size=8, codec=codec,
                      dtype=dtype)
    target, read = gpu_target(45, dtype, layout)
    with ContainerReader(f.path) as reader:
        outcome = load(file_tasks(reader, 45), target)
        assert outcome.error is None and outcome.loaded_tokens == 45
        want = reader.read_range(0, 45)
    assert torch.equal(read(0, 45), want)


@needs_cuda
@pytest.mark.parametrize("codec", ["raw", "cachegen"])
def test_a_damaged_chunk_never_reaches_gpu_buffers(tmp_path, codec):
    from kvtool.load import load

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=48, chunk_size=8, codec=codec,
                      dtype=torch.float32)
    flip_payload_byte(f.path, 3, 1, 0x08)
    target, read = gpu_target(48)
    with ContainerReader(f.path) as reader:
        outcome = load(file_tasks(reader, 48), target)
        want = reader.read_range(0, 24)
    assert isinstance(outcome.error, ChecksumMismatch) and "chunk 3" in str(outcome.error)
    assert outcome.loaded_tokens <= 24
    assert not read(24, 32).any()  # the damaged chunk's tokens were never written
    if codec == "raw":  # the staged path scatters in order: the chunks before it are there
        assert outcome.loaded_tokens == 24 and torch.equal(read(0, 24), want)


@needs_cuda
@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
def test_the_store_loads_into_gpu_buffers_what_it_loads_on_the_cpu(tmp_path, codec):
    """The store's prefix API into paged buffers on the GPU, from a token on: the CPU load's KV."""
    from kvtool.store import open_store

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(100, 140))
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=8)
    cache.put_sequence(tokens, make_kv(identity, 40, torch.float32), codec=codec)
    on_cpu, read_cpu = paged_target(40)
    assert cache.load_prefix(tokens, on_cpu, from_token=12).num_tokens == 40
    target, read = gpu_target(40)
    hit = cache.load_prefix(tokens, target, from_token=12)
    assert hit.num_tokens == 40 and hit.codecs == [codec] * 4 and not hit.refused
    assert torch.equal(read(12, 40), read_cpu(12, 40)) and not read(0, 12).any()


def test_a_memory_tier_in_front_of_a_folder_keeps_the_one_pass_load(tmp_path, monkeypatch):
    """`Backend.open` is part of every backend's contract, tiers included (before, TieredBackend did
    not forward the file methods, and every load through a memory tier read each object whole,
    then copied and checked it privately, then scattered it). Now an object the memory tier holds
    is scattered from memory and checked as copied; one it can hold is read once and copied up;
    one too large for it stays a file, read in place as it is scattered."""
    from kvtool.chunk_source import ChunkSource
    from kvtool.store import open_store

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(500, 532))
    kv = make_kv(identity, 32, torch.float32)
    open_store(tmp_path / "store").for_model(identity, chunk_size=8).put_sequence(tokens, kv)
    seen: list[ChunkSource] = []
    real = ChunkSource.release

    def spy(self):
        seen.append((self.in_file, self.data is not None))
        real(self)

    monkeypatch.setattr(ChunkSource, "release", spy)
    for memory_bytes, in_file in ((1 << 20, False), (1000, True)):  # objects of ~2 KB: held, or too large
        tiered = open_store(tmp_path / "store", memory_bytes=memory_bytes)
        cache = tiered.for_model(identity, chunk_size=8)
        for round in range(2):
            seen.clear()
            scatter, read = paged_target(32, checking=True)
            hit = cache.load_prefix(tokens, scatter)
            assert hit.num_tokens == 32 and torch.equal(read(0, 32), kv)
            assert seen == [(in_file, not in_file)] * 4, (memory_bytes, round)
        held = [tiered.backend.tiers[0].exists(n) for n in cache.chunk_names(tokens)]
        assert held == [not in_file] * 4


@pytest.mark.parametrize("damaged", [None, 0, 3, 6])
def test_the_gpu_decode_groups_read_ahead_and_stop_at_a_damaged_chunk(tmp_path, monkeypatch, damaged):
    """The GPU's CacheGen path (groups decoded in one launch each, the next group read and checked
    on worker threads meanwhile), run on the CPU: every chunk before the damaged one's group is
    loaded, none after, and every chunk opened, read ahead or not, is released."""
    from kvtool.load import path as load_module

    monkeypatch.setattr(load_module, "GPU_DECODE_BATCH", 2)
    opened, released = [], set()
    real = ChunkSource.release
    monkeypatch.setattr(ChunkSource, "release", lambda self: (released.add(id(self)), real(self)))
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=56, chunk_size=8, codec="cachegen",
                      dtype=torch.float32)
    if damaged is not None:
        flip_payload_byte(f.path, damaged, 1, 0x08)
    target, read = paged_target(56, checking=False)
    with ContainerReader(f.path) as reader:
        tasks = [ChunkTask(t.start, t.end, (lambda o: lambda: opened.append(o()) or opened[-1])(t.open),
                           t.origin, t.codec) for t in file_tasks(reader, 56)]
        outcome = load_module._decode_on_device(tasks, target, torch.device("cpu"))
        good = 56 if damaged is None else 16 * (damaged // 2)
        assert outcome.loaded_tokens == good and outcome.chunks == good // 8
        assert (outcome.error is None) == (damaged is None)
        if damaged is not None:
            assert isinstance(outcome.error, ChecksumMismatch) and f"chunk {damaged}" in str(outcome.error)
        if good:
            assert torch.equal(read(0, good), reader.read_range(0, good))
        if good < 56:
            assert not read(good, 56).any()
    # each group read while the one before decodes; none past a group that failed to read
    assert len(opened) == (7 if damaged is None else min(7, 2 * (damaged // 2 + 1)))
    assert all(id(source) in released for source in opened)


def together_target(num_tokens: int, seed: int = 0):
    """`paged_target`'s buffers behind the connector's own load destination (`connector.target`),
    which takes runs of raw chunks in one native call (`scatter_sources`)."""
    target, read = paged_target(num_tokens, seed)
    return target.connector.target(**target.kwargs), read


def counting_calls(monkeypatch) -> list[int]:
    """The number of chunks of each native `scatter_checked_many` call from here on."""
    from kvtool.connectors import paged_native

    module = paged_native.native_module()
    if module is None:
        pytest.skip("kvtool._paged_native is not built")
    calls: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(module, name)

        def scatter_checked_many(self, segs, payloads, *rest):
            calls.append(len(payloads))
            return module.scatter_checked_many(segs, payloads, *rest)

    monkeypatch.setattr(paged_native, "native_module", lambda: Counting())
    return calls


@pytest.mark.parametrize("damage", [None, "crc", "nan", "open"])
def test_raw_chunks_of_a_file_go_together_and_the_first_refusal_ends_the_load(tmp_path, monkeypatch, damage):
    """A file's raw chunks (in its mapping) are copied and checked by one native call; a chunk
    refused there (damaged bytes, a NaN written with a valid CRC) or one that fails to open ends
    the load at it, as chunk by chunk: the chunks before it loaded, reported."""
    from kvtool.errors import NonFiniteValues

    calls = counting_calls(monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    kv = make_kv(identity, 48, torch.float32, 0)
    if damage == "nan":
        kv[1, 0, 33, 5] = float("nan")  # chunk 4
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=48, chunk_size=8, dtype=torch.float32, kv=kv)
    if damage == "crc":
        flip_payload_byte(f.path, 3, 1, 0x08)
    target, read = together_target(48)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, 48)
        if damage == "open":
            def broken():
                raise DecodeError("chunk 5: broken on purpose")
            tasks[5] = ChunkTask(tasks[5].start, tasks[5].end, broken)
        outcome = load_chunks(tasks, target, threads=2)
    failed = {None: None, "crc": 3, "nan": 4, "open": 5}[damage]
    error = {None: type(None), "crc": ChecksumMismatch, "nan": NonFiniteValues, "open": DecodeError}[damage]
    assert isinstance(outcome.error, error) and outcome.failed == failed
    loaded = 48 if failed is None else 8 * failed
    assert (outcome.loaded_tokens, outcome.chunks) == (loaded, loaded // 8)
    assert torch.equal(read(0, loaded), f.kv[:, :, :loaded])
    if damage in (None, "crc", "nan"):
        assert calls == [6]  # one call for the six chunks
    else:
        assert calls == [5]  # the chunks before the one that failed to open


def test_a_run_together_ends_where_a_chunk_cannot_join_it_and_the_rest_load_chunk_by_chunk(tmp_path, monkeypatch):
    calls = counting_calls(monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=48, chunk_size=8, dtype=torch.float32,
                      codecs_per_chunk=[("raw", None), ("raw", None), ("zstd", None)])
    target, read = together_target(48)
    with ContainerReader(f.path) as reader:
        outcome = load_chunks(file_tasks(reader, 48), target, threads=2)
    assert outcome.error is None and outcome.loaded_tokens == 48
    assert torch.equal(read(0, 48), f.kv)
    assert calls == [2]  # chunks 0-1 together; from the zstd chunk 2 on, one by one


def test_a_run_refused_as_a_whole_loads_chunk_by_chunk_and_names_the_chunk(tmp_path, monkeypatch):
    """A slot mapping with a cached token's -1 inside chunk 2: the run's slot check refuses it;
    chunk by chunk (the chunks open already, not opened again), chunks 0-1 load and the refusal
    names chunk 2's range."""
    from kvtool.errors import ConnectorError

    calls = counting_calls(monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=32, chunk_size=8, dtype=torch.float32)
    target, read = together_target(32)
    target.kwargs["slot_mapping"] = target.kwargs["slot_mapping"].clone()
    target.kwargs["slot_mapping"][19] = -1
    opened = []
    with ContainerReader(f.path) as reader:
        tasks = [ChunkTask(t.start, t.end, lambda t=t: opened.append(t.start) or t.open(), codec=t.codec)
                 for t in file_tasks(reader, 32)]
        outcome = load_chunks(tasks, target, threads=2)
    assert isinstance(outcome.error, ConnectorError) and "slot_mapping[19] is -1" in str(outcome.error)
    assert (outcome.loaded_tokens, outcome.chunks, outcome.failed) == (16, 2, 2)
    assert torch.equal(read(0, 16), f.kv[:, :, :16])
    assert calls == [] and opened == [0, 8, 16, 24]  # (the run was refused before the native call)


def test_a_load_from_inside_a_chunk_loads_that_chunk_alone_and_the_rest_together(tmp_path, monkeypatch):
    calls = counting_calls(monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=48, chunk_size=8, dtype=torch.float32)
    target, read = together_target(48)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, 48)
        tasks[0] = ChunkTask(5, 8, tasks[0].open, origin=0, codec=tasks[0].codec)  # the engine holds tokens 0-4
        outcome = load_chunks(tasks, target, threads=2)
    assert outcome.error is None and outcome.loaded_tokens == 48
    assert torch.equal(read(5, 48), f.kv[:, :, 5:]) and not read(0, 5).any()
    assert calls == [5]


def test_the_store_loads_a_hot_prefix_together_and_refuses_an_object_damaged_in_place(tmp_path, monkeypatch):
    """Objects of a realistic size (1 MiB of KV a chunk: the store loads them on every thread),
    kept from an earlier load: one native call; one of them changed in place with its time put
    back is refused there, by its name, and the prefix before it loads. Every source opened is
    released."""
    import os

    from kvtool.chunk_source import ChunkSource as Source
    from kvtool.store import loading, open_store

    loading.forget_checked()
    layers, heads, dim, chunk = 4, 4, 64, 256  # 2 x 4 x 256 x 256 x 2 bytes: 1 MiB of bf16 KV a chunk
    identity = make_identity(num_layers=layers, num_kv_heads=heads, head_dim=dim)
    kv = make_kv(identity, 4 * chunk, torch.bfloat16, 0)
    tokens = list(range(1000, 1000 + 4 * chunk))
    cache = open_store(str(tmp_path / "s")).for_model(identity, chunk_size=chunk)
    cache.put_sequence(tokens, kv)
    names = cache.chunk_names(tokens)
    for name in names:
        os.utime(cache.backend._path(name), ns=(10**18, 10**18))  # written long ago: kept when loaded

    def paged():
        blocks = 4 * chunk // 16 + 1
        caches = [torch.zeros(2, blocks, 16, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
        connector = PagedMemConnectorV2(heads * dim, layers, layout="flash_attn", num_kv_heads=heads, head_dim=dim)
        slots = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[torch.arange(4 * chunk) // 16] * 16 \
            + torch.arange(4 * chunk) % 16

        def read(end):
            out = connector.allocate(end, torch.bfloat16)
            connector.from_gpu(out, 0, end, kvcaches=caches, slot_mapping=slots)
            return out.tensor
        return connector.target(kvcaches=caches, slot_mapping=slots), read

    try:
        dest, read = paged()
        assert cache.load_prefix(tokens, dest).num_tokens == 4 * chunk  # kept now
        calls = counting_calls(monkeypatch)
        released = []
        real_release = Source.release
        monkeypatch.setattr(Source, "release", lambda self: released.append(self) or real_release(self))
        path = cache.backend._path(names[2])
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(st.st_size // 2)  # inside the payload (all but a few KB of the object)
            byte = f.read(1)
            f.seek(st.st_size // 2)  # inside the payload (all but a few KB of the object)
            f.write(bytes([byte[0] ^ 0x01]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # its time put back
        dest, read = paged()
        hit = cache.load_prefix(tokens, dest)
        assert hit.num_tokens == 2 * chunk and len(hit.refused) == 1 and names[2] in hit.refused[0]
        assert torch.equal(read(2 * chunk), kv[:, :, :2 * chunk])
        assert calls == [4] and len(released) >= 4
    finally:
        loading.forget_checked()


# --- the destination is declared, the codec asked (issue 47, finding 5) ---------------------------


def test_the_load_asks_the_destination_what_it_takes_never_probes_it(tmp_path):
    """A destination that has a `scatter_source` but does not say it takes sources gets every chunk
    decoded through `scatter` (before: `hasattr` found the method and called it)."""
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=32, chunk_size=8, dtype=torch.float32)
    target, read = paged_target(32)

    class Declared(Destination):
        device = target.device

        def scatter(self, kv, start, end):
            target.scatter(kv, start, end)

        def scatter_source(self, source, start, end):  # there, but not taken: takes_sources() is False
            raise AssertionError("scatter_source called on a destination that does not take sources")

    for threads in (1, 2):
        with ContainerReader(f.path) as reader:
            outcome = load_chunks(file_tasks(reader, 32), Declared(), threads=threads)
        assert outcome.error is None and outcome.loaded_tokens == 32
        assert torch.equal(read(0, 32), f.kv)


def test_an_undeclared_destination_still_loads_decoded_kv_with_a_deprecation(tmp_path):
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=16, chunk_size=8, dtype=torch.float32)
    target, read = paged_target(16)

    class Plain:  # what a destination was before Destination was declared: device and scatter
        device = target.device
        scatter = staticmethod(target.scatter)

    with ContainerReader(f.path) as reader, pytest.warns(DeprecationWarning, match="subclass kvtool.load.Destination"):
        outcome = load(file_tasks(reader, 16), Plain())
    assert outcome.error is None and torch.equal(read(0, 16), f.kv)


def test_the_load_asks_the_codec_how_a_chunk_loads_never_its_name(tmp_path, monkeypatch):
    """A file's tasks carry their codecs (the codec table's objects): raw chunks go together in one
    native call, a zstd chunk is decoded; CacheGen's says it decodes in device batches. A codec
    given by name is deprecated and ignored."""
    from kvtool.codecs import get_codec

    assert get_codec("cachegen").decodes_in_device_batches
    assert not any(get_codec(name).decodes_in_device_batches for name in ("raw", "zstd", "pca"))
    calls = counting_calls(monkeypatch)
    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    f = write_kv_file(tmp_path / "f.kvc", identity=identity, num_tokens=32, chunk_size=8, dtype=torch.float32,
                      codecs_per_chunk=[("raw", None), ("raw", None), ("raw", None), ("zstd", None)])
    target, read = together_target(32)
    with ContainerReader(f.path) as reader:
        tasks = file_tasks(reader, 32)
        assert [t.codec for t in tasks] == [get_codec("raw")] * 3 + [get_codec("zstd")]
        outcome = load_chunks(tasks, target, threads=2)
    assert outcome.error is None and torch.equal(read(0, 32), f.kv)
    assert calls == [3]  # (before: a task's codec compared with "raw" by name)
    with pytest.warns(DeprecationWarning, match="get_codec"):
        assert ChunkTask(0, 8, tasks[0].open, codec="raw").codec is None


def test_the_load_path_names_no_codec_and_probes_nothing():
    """The source of kvtool/load: no `hasattr` probe, no codec named by string."""
    import re
    from pathlib import Path

    import kvtool.load

    for path in Path(kvtool.load.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "hasattr(" not in text, path
        assert not re.search(r"""codec\s*(==|!=|not in|in)\s*[("']""", text), path
        assert not re.search(r"""["'](raw|zstd|cachegen|pca)["']""", text), path
