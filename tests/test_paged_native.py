"""The native CPU paged gather/scatter (kernels/paged_copy_cpu.c, connectors/paged_native.py)
against the torch reference (connectors/paged_torch.py): the same bytes on every layout, dtype
and stride pattern; out-of-range rows refused before anything is written."""

from __future__ import annotations

import os
import signal
import struct

import pytest
import torch

from kvtool.connectors import paged_native, paged_torch
from kvtool.connectors.paged_layout import PagedLayout
from test_connectors import LAYOUTS, _strided_cases, clone_buffers, buffers_equal, make_buffers, shuffled_slots
from fixtures import raw_source

native = paged_native.native_module()
needs_native = pytest.mark.skipif(native is None, reason="kvtool._paged_native is not built (no C compiler)")


def test_ci_builds_the_extension():  # not skipped: without the extension CI must fail here
    assert native is not None or os.environ.get("CI") != "true"


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,blob_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("head_dim", [8, 32])
def test_same_bytes_as_the_torch_reference(layout, dtype, blob_dtype, head_dim, nontemporal):
    gen = torch.Generator().manual_seed(1)
    T, BS, L, H, D = 133, 16, 3, 2, head_dim
    NB = 12
    bufs = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    blob = torch.randn(2, L, T, H * D, generator=gen).to(blob_dtype)
    ref, out = clone_buffers(bufs, layout), clone_buffers(bufs, layout)
    paged_torch.torch_scatter(blob, ref, PagedLayout(layout), slots)
    assert paged_native.native_scatter(blob, out, PagedLayout(layout), slots)
    assert buffers_equal(ref, out, layout)
    if blob_dtype == dtype:
        want, got = torch.empty_like(blob), torch.empty_like(blob)
        paged_torch.torch_gather(bufs, PagedLayout(layout), slots, want)
        assert paged_native.native_gather(bufs, PagedLayout(layout), slots, got)
        assert torch.equal(want, got)
    else:  # a converting gather is the reference's case
        assert not paged_native.native_gather(bufs, PagedLayout(layout), slots, torch.empty_like(blob))


@needs_native
def test_same_bytes_on_strided_buffers():
    gen = torch.Generator().manual_seed(2)
    T, BS, L, H, D = 77, 8, 2, 3, 8
    for name, layout, bufs in _strided_cases(L, 10, BS, H, D, gen):
        slots = shuffled_slots(T, 10, BS, gen)
        _, blob, check = _payload_blob((2, L, T, H * D), torch.float32, gen)  # in a "stored" buffer
        ref, out, checked = (clone_buffers(bufs, layout) for _ in range(3))
        paged_torch.torch_scatter(blob.clone(), ref, PagedLayout(layout), slots)
        assert paged_native.native_scatter(blob, out, PagedLayout(layout), slots), name
        assert buffers_equal(ref, out, layout), name
        assert paged_native.native_scatter_source(check, checked, PagedLayout(layout), slots), name
        assert buffers_equal(ref, checked, layout), name
        want, got = torch.empty_like(blob), torch.empty_like(blob)
        paged_torch.torch_gather(bufs, PagedLayout(layout), slots, want)
        assert paged_native.native_gather(bufs, PagedLayout(layout), slots, got), name
        assert torch.equal(want, got), name


def _segment(paged, blob, slots, *, block_size=1, groups=1, a=0, sb=32, so=0, sh=0, run=32, stride=0, elem=4,
             paged_bytes=None):
    """One segment for kernels/paged_copy_cpu.c: 14 uint64 (byte offsets)."""
    return struct.pack("<14Q", paged.data_ptr(), paged.numel() * 4 if paged_bytes is None else paged_bytes,
                       blob if isinstance(blob, int) else blob.data_ptr(), slots.numel(), slots.data_ptr(),
                       block_size, groups, a, sb, so, sh, run, stride, elem)


@needs_native
def test_slots_out_of_range_are_refused_before_any_write():
    paged, blob = torch.zeros(4, 8), torch.ones(3, 8)  # 4 rows of 32 bytes
    for slots in ([0, 1, 4], [0, -1, 2]):
        index = torch.tensor(slots, dtype=torch.int64)
        with pytest.raises(IndexError, match="out of range"):
            native.copy_segments(_segment(paged, blob, index), 1, 2)
        assert not paged.any()
    index = torch.tensor([0, 1, 3], dtype=torch.int64)
    # strided rows of 8 floats 16 bytes apart: slot 3's row at byte 96 reaches byte 96 + 7*16 + 4 > 128
    with pytest.raises(IndexError):
        native.copy_segments(_segment(paged, blob, index, stride=16, elem=4), 1, 1)
    with pytest.raises(IndexError):  # elements closer than their size
        native.copy_segments(_segment(paged, blob, index, stride=2, elem=4), 1, 1)
    with pytest.raises(IndexError):  # a second group past the end
        native.copy_segments(_segment(paged, torch.ones(6, 8), index, groups=2, sh=24, run=16), 1, 1)
    with pytest.raises(IndexError):  # a stride so large that the address would wrap around
        native.copy_segments(_segment(paged, blob, index, sb=2**63), 1, 1)
    assert not paged.any()


@needs_native
@pytest.mark.parametrize("count", [0, 1, 2, 255, 256, 511, 513, 5000])
def test_the_native_slot_check_agrees_with_torch(count):
    """slots_ok (the connectors' fast check of a slot mapping) against its definition, on sizes
    either side of where its set of seen slots moves from the stack to the heap: every slot in
    [0, num_slots), and none twice when asked."""
    gen = torch.Generator().manual_seed(count)
    num_slots = 3 * count + 7
    good = torch.randperm(num_slots, generator=gen)[:count].to(torch.int64)

    def ok(slots, distinct):
        return native.slots_ok(slots.data_ptr(), slots.numel(), num_slots, distinct)

    assert ok(good, True) and ok(good, False)
    if count < 2:
        return
    for i in (0, count // 2, count - 1):
        for bad in (-1, -5, num_slots, num_slots + 100):
            slots = good.clone()
            slots[i] = bad
            assert not ok(slots, True) and not ok(slots, False), (i, bad)
        twice = good.clone()
        twice[i] = good[(i + 1) % count]
        assert not ok(twice, True) and ok(twice, False), i
    assert paged_native.native_slots_ok(good, num_slots, True)
    assert paged_native.native_slots_ok(good.to(torch.int32), num_slots, True) is None  # the torch checks run


@needs_native
def test_a_template_call_is_the_segments_it_stands_for():
    """copy_segments and scatter_checked with a template (the blob's part index where its address
    goes; this call's blob, tokens and slots given apart) copy what the filled-in segments copy,
    and a forged part index is refused before anything is written."""
    paged, blob = torch.zeros(2, 8, 8), torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    slots = torch.tensor([5, 0, 2], dtype=torch.int64)
    template = b"".join(_segment(paged[kv], 0, slots, sb=32, run=32) for kv in (0, 1))
    template = bytearray(template)
    for kv in (0, 1):  # the part index in the blob field, tokens and slots left zero
        struct.pack_into("<3Q", template, kv * 112 + 16, kv, 0, 0)
    native.copy_segments(bytes(template), 1, 2, blob.data_ptr(), 3, slots.data_ptr())
    want = torch.zeros(2, 8, 8)
    want[:, slots] = blob
    assert torch.equal(paged, want)
    back = torch.zeros_like(blob)
    native.copy_segments(bytes(template), 0, 1, back.data_ptr(), 3, slots.data_ptr())
    assert torch.equal(back, blob)
    paged.zero_()
    payload = memoryview(blob.numpy()).cast("B")
    crc = native.scatter_checked(bytes(template), payload, 2, blob.data_ptr(), 3, slots.data_ptr())
    assert crc == native.crc32c(payload) and torch.equal(paged, want)
    paged.zero_()
    struct.pack_into("<Q", template, 112 + 16, 2**62)  # V's part far past any blob
    with pytest.raises(IndexError):
        native.scatter_checked(bytes(template), payload, 2, blob.data_ptr(), 3, slots.data_ptr())
    assert not paged.any()


@needs_native
def test_strided_rows_land_one_element_per_stride():
    """A transposed page (vLLM's CPU K): slot s's 4 channels go to paged[s + 4 * j]."""
    paged, blob = torch.zeros(16), torch.arange(8, dtype=torch.float32).view(2, 4)
    slots = torch.tensor([1, 2], dtype=torch.int64)
    segment = _segment(paged, blob, slots, sb=4, run=16, stride=16, elem=4)
    native.copy_segments(segment, 1, 1)
    want = torch.zeros(16)
    want[[1, 5, 9, 13]] = blob[0]
    want[[2, 6, 10, 14]] = blob[1]
    assert torch.equal(paged, want)
    back = torch.zeros(2, 4)
    native.copy_segments(_segment(paged, back, slots, sb=4, run=16, stride=16, elem=4), 0, 1)
    assert torch.equal(back, blob)


# --- CRC-32C while copying (kernels/crc32c_cpu.c) and the checked scatter ---------------------

CRC_LEVELS = [3, 2, 1, 0]  # 256-bit VPCLMULQDQ folding, PCLMULQDQ folding, the crc32 instruction, the table (each where the CPU has it)


@pytest.fixture
def crc_level(request):
    """Run the test with the native CRC-32C forced down to `request.param` (the best one the CPU
    has at most), and put the best one back afterwards."""
    best = native.crc32c_level()
    got = native.crc32c_set_level(request.param)
    try:
        yield got
    finally:
        native.crc32c_set_level(best)


@pytest.fixture(params=[False, True], ids=["cached-stores", "non-temporal-stores"])
def nontemporal(request):
    """Run the test with every copy written by plain or by non-temporal stores (the kernel picks
    by size; small test buffers would otherwise never take the second)."""
    previous = native.nontemporal_min(0 if request.param else 1 << 62)
    try:
        yield request.param
    finally:
        native.nontemporal_min(previous)


@pytest.fixture(params=[512, 256, 128], ids=["stores-512", "stores-256", "stores-128"])
def stream_width(request):
    """Run the test with non-temporal copies of whole lines on registers of at most
    `request.param` bits (the widest the CPU has at most; 128: the 16-byte loop), every copy
    non-temporal, and put the widest back afterwards."""
    got = native.stream_width(request.param)
    previous = native.nontemporal_min(0)
    try:
        yield got
    finally:
        native.nontemporal_min(previous)
        native.stream_width(512)


@pytest.fixture(params=[True, False], ids=["mapped", "windowed"])
def file_reads(request):
    """Run the test with payloads in files mapped behind the fault guard, or read a window at a
    time (the kernel's way where it cannot map a file)."""
    previous = native.map_min_bytes(0 if request.param else 1 << 62)
    try:
        yield request.param
    finally:
        native.map_min_bytes(previous)


@needs_native
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_crc32c_matches_the_crc32c_package(crc_level):
    import crc32c

    gen = torch.Generator().manual_seed(5)
    data = bytes(torch.randint(0, 256, (200_100,), generator=gen, dtype=torch.uint8).tolist())
    lengths = list(range(0, 300)) + [511, 512, 513, 4095, 4096, 4097, 100_003, 200_000]
    for n in lengths:
        for at in (0, 1, 13):  # unaligned starts
            piece = data[at:at + n]
            assert native.crc32c(piece) == crc32c.crc32c(piece), (n, at)
    for n in (0, 1, 33, 255, 4096, 100_003):
        piece = data[:n]
        for cut in {0, n // 3, n}:
            a, b = crc32c.crc32c(piece[:cut]), crc32c.crc32c(piece[cut:])
            assert native.crc32c_combine(a, b, n - cut) == crc32c.crc32c(piece), (n, cut)


@needs_native
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_copy_checked_copies_and_checks_any_size(crc_level, nontemporal):
    import crc32c

    gen = torch.Generator().manual_seed(9)
    data = torch.randint(0, 256, (70_010,), generator=gen, dtype=torch.uint8)
    for n in (0, 1, 63, 64, 65, 128, 1000, 4096, 69_999):
        for at in (0, 5):
            src = data[at:at + n].numpy().tobytes()
            dst = torch.zeros(n + 3, dtype=torch.uint8)
            out = dst[3:] if at else dst[:n]  # an unaligned destination too
            assert native.copy_checked(memoryview(out.numpy()), src) == crc32c.crc32c(src), (n, at)
            assert out.numpy().tobytes() == src, (n, at)


def _payload_blob(shape, dtype, gen):
    """A KV_BLOB living in a bytearray (as a mapped chunk lives in its file), and its ChunkSource."""
    from kvtool.checksum import crc32

    values = torch.randn(*shape, generator=gen).to(dtype)
    payload = bytearray(values.view(torch.uint8).reshape(-1).numpy().tobytes())
    view = torch.frombuffer(payload, dtype=dtype).view(shape)
    return payload, view, raw_source(shape, dtype, data=payload, crc=crc32(payload), what="chunk 7")


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 32])  # rows of 16-32 bytes; rows of whole 64-byte units (the fold runs on)
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_checked_scatter_writes_the_reference_bytes(layout, dtype, head_dim, crc_level, nontemporal, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    T, BS, L, H, D, NB = 133, 16, 3, 2, head_dim, 12
    bufs = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    _, view, check = _payload_blob((2, L, T, H * D), dtype, gen)
    ref, out = clone_buffers(bufs, layout), clone_buffers(bufs, layout)
    paged_torch.torch_scatter(view.clone(), ref, PagedLayout(layout), slots)
    for threads in ("1", "3"):
        monkeypatch.setenv("KVTOOL_THREADS", threads)
        assert paged_native.native_scatter_source(check, out, PagedLayout(layout), slots)
        assert buffers_equal(ref, out, layout), threads


@needs_native
@pytest.mark.parametrize("where", [0, 1, -1])
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_checked_scatter_refuses_a_changed_byte_anywhere(where, crc_level, monkeypatch):
    from kvtool.errors import ChecksumMismatch

    monkeypatch.setenv("KVTOOL_THREADS", "2")
    gen = torch.Generator().manual_seed(6)
    T, BS, L, H, D, NB = 64, 16, 2, 2, 16, 6
    bufs = make_buffers("flash_attn", L, NB, BS, H, D, torch.float32, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    payload, view, check = _payload_blob((2, L, T, H * D), torch.float32, gen)
    payload[where * (len(payload) // 2) if where != -1 else -1] ^= 0x10  # first, middle or last byte
    with pytest.raises(ChecksumMismatch, match="chunk 7: CRC-32C mismatch"):
        paged_native.native_scatter_source(check, bufs, PagedLayout("flash_attn"), slots)


@needs_native
def test_checked_scatter_refuses_segments_outside_the_payload_before_any_write():
    paged, slots = torch.zeros(4, 8), torch.tensor([0, 1, 2], dtype=torch.int64)
    payload = bytearray(3 * 32)
    base = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    one = torch.tensor([0], dtype=torch.int64)
    for segments in (_segment(paged, base + 32, slots),  # runs past the payload's end
                     _segment(paged, base - 32, one),  # starts before it
                     _segment(paged, base, torch.tensor([0, 1, 4])),  # a slot past the paged tensor
                     _segment(paged, base + 64, one) + _segment(paged, base, one)):  # out of order
        with pytest.raises(IndexError):
            native.scatter_checked(segments, payload, 2)
    assert not paged.any()


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_slot_order_gives_the_reference_bytes(layout):
    """Slots in no order at all (runs of consecutive slots broken anywhere, blocks half used):
    the tiled copies of transposed pages and the checked scatter still match the reference."""
    from kvtool.checksum import crc32

    gen = torch.Generator().manual_seed(8)
    T, BS, L, H, D, NB = 90, 16, 2, 2, 8, 8
    bufs = make_buffers(layout, L, NB, BS, H, D, torch.float32, gen)
    others = torch.randperm(NB * BS, generator=gen)
    others = others[(others < 40) | (others >= 60)]
    slots = torch.cat([others[:10], torch.arange(40, 60), others[10:T - 20]])  # one run across a block boundary
    blob = torch.randn(2, L, T, H * D, generator=gen)
    ref, out, checked = (clone_buffers(bufs, layout) for _ in range(3))
    paged_torch.torch_scatter(blob, ref, PagedLayout(layout), slots)
    assert paged_native.native_scatter(blob, out, PagedLayout(layout), slots)
    assert buffers_equal(ref, out, layout)
    payload = bytearray(blob.view(torch.uint8).reshape(-1).numpy().tobytes())
    view = torch.frombuffer(payload, dtype=torch.float32).view(blob.shape)
    check = raw_source(tuple(blob.shape), torch.float32, data=payload, crc=crc32(payload), what="chunk 0")
    assert paged_native.native_scatter_source(check, checked, PagedLayout(layout), slots)
    assert buffers_equal(ref, checked, layout)
    got = torch.empty_like(blob)
    assert paged_native.native_gather(ref, PagedLayout(layout), slots, got)
    assert torch.equal(got, blob)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [4, 8])
def test_transposed_pages_of_large_blocks(dtype, H, nontemporal):
    """vLLM's CPU layout at its own block size (128): a run of slots is more than the kernel's
    tile buffer holds (it goes in parts; 8 heads of fp32: a whole block's gather too, through
    half the buffer), whole blocks and partial ones, plain and checked."""
    gen = torch.Generator().manual_seed(12)
    T, BS, L, D, NB = 300, 128, 2, 64, 5
    layout = PagedLayout("vllm_cpu")
    bufs = make_buffers("vllm_cpu", L, NB, BS, H, D, dtype, gen)
    order = torch.randperm(NB, generator=gen)
    t = torch.arange(T) + 40  # the first block partly cached: runs start mid-block
    slots = order[t // BS] * BS + t % BS
    _, view, check = _payload_blob((2, L, T, H * D), dtype, gen)
    ref, out, checked = (clone_buffers(bufs, "vllm_cpu") for _ in range(3))
    paged_torch.torch_scatter(view.clone(), ref, layout, slots)
    assert paged_native.native_scatter(view, out, layout, slots)
    assert buffers_equal(ref, out, "vllm_cpu")
    assert paged_native.native_scatter_source(check, checked, layout, slots)
    assert buffers_equal(ref, checked, "vllm_cpu")
    got = torch.empty_like(view)
    assert paged_native.native_gather(ref, layout, slots, got)
    assert torch.equal(got, view)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,H,D", [(torch.float32, 3, 8), (torch.bfloat16, 2, 64)])
def test_every_store_width_gives_the_reference_bytes(layout, dtype, H, D, stream_width):
    """Whole-line non-temporal copies on each register width: runs of slots that start at a
    block's start and inside one (copies of whole lines and with a tail), blob parts that start
    off a line (3 heads of 8 fp32: 96-byte tokens, 133 of them) and on one, gather and scatter."""
    gen = torch.Generator().manual_seed(21)
    T, BS, L, NB = 133, 16, 2, 12
    bufs = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    order = torch.randperm(NB, generator=gen)
    t = torch.arange(T) + 5  # the first run starts inside its block
    slots = order[t // BS] * BS + t % BS
    blob = torch.randn(2, L, T, H * D, generator=gen).to(dtype)
    ref, out = clone_buffers(bufs, layout), clone_buffers(bufs, layout)
    paged_torch.torch_scatter(blob, ref, PagedLayout(layout), slots)
    assert paged_native.native_scatter(blob, out, PagedLayout(layout), slots)
    assert buffers_equal(ref, out, layout)
    want, got = torch.empty_like(blob), torch.empty_like(blob)
    paged_torch.torch_gather(bufs, PagedLayout(layout), slots, want)
    assert paged_native.native_gather(bufs, PagedLayout(layout), slots, got)
    assert torch.equal(want, got)


def _file_payload(tmp_path, shape, dtype, gen, lead=100, cut=0):
    """A KV_BLOB stored `lead` bytes into a file (its last `cut` bytes missing), and the
    ChunkSource of it a store load hands on (the payload still in its file)."""
    from kvtool.checksum import crc32

    payload = (torch.randn(*shape, generator=gen) * 3).to(dtype).view(torch.uint8).reshape(-1).numpy().tobytes()
    path = tmp_path / "object"
    path.write_bytes(b"\x5a" * lead + payload[:len(payload) - cut] + (b"" if cut else b"tail"))
    check = raw_source(shape, dtype, fd=os.open(path, os.O_RDONLY), offset=lead, crc=crc32(payload), what="chunk 7")
    return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape), None, check


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,H,D,BS", [(torch.float32, 2, 8, 16),  # many segments in a window
                                          (torch.float32, 8, 64, 16),  # a segment across windows (600 KB)
                                          (torch.bfloat16, 4, 64, 128)])  # vLLM's CPU block size
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_a_payload_in_a_file_is_scattered_as_from_memory(
        tmp_path, layout, dtype, H, D, BS, crc_level, nontemporal, file_reads, monkeypatch):
    gen = torch.Generator().manual_seed(21)
    T, L = 300, 2
    NB = T // BS + 3
    bufs = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    t = torch.arange(T) + 5  # runs start mid-block
    slots = torch.randperm(NB, generator=gen)[t // BS] * BS + t % BS
    blob, view, check = _file_payload(tmp_path, (2, L, T, H * D), dtype, gen)
    ref = clone_buffers(bufs, layout)
    paged_torch.torch_scatter(blob, ref, PagedLayout(layout), slots)
    try:
        for threads in ("1", "3"):
            out = clone_buffers(bufs, layout)
            monkeypatch.setenv("KVTOOL_THREADS", threads)
            maps = native.file_maps()
            assert paged_native.native_scatter_source(check, out, PagedLayout(layout), slots)
            assert native.file_maps() == maps + file_reads  # (mapped, not fallen back to windows)
            assert buffers_equal(ref, out, layout), threads
            assert check.data is None  # read by the kernel, never whole into memory
    finally:
        check.release()


@needs_native
def test_a_payload_in_a_file_refuses_a_changed_byte_a_short_file_and_a_failed_read(tmp_path, file_reads):
    from kvtool.errors import ChecksumMismatch, InputFileError

    gen = torch.Generator().manual_seed(22)
    L, T, H, D, BS = 2, 64, 4, 64, 16
    layout = PagedLayout("flash_attn")
    bufs = make_buffers("flash_attn", L, 6, BS, H, D, torch.float32, gen)
    slots = shuffled_slots(T, 6, BS, gen)
    shape = (2, L, T, H * D)
    _, view, check = _file_payload(tmp_path, shape, torch.float32, gen)
    with open(tmp_path / "object", "r+b") as f:  # one byte changed in the middle of the payload
        f.seek(100 + check.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(ChecksumMismatch, match="chunk 7: CRC-32C mismatch"):
        paged_native.native_scatter_source(check, bufs, layout, slots)
    check.release()
    _, view, check = _file_payload(tmp_path, shape, torch.float32, gen, cut=1000)
    with pytest.raises(ChecksumMismatch, match="chunk 7: the file ends inside the payload"):
        paged_native.native_scatter_source(check, bufs, layout, slots)
    check.release()
    _, view, check = _file_payload(tmp_path, shape, torch.float32, gen)
    fd = check.fd
    os.close(fd)  # a read that fails (EBADF): reported, not taken for damage
    with pytest.raises(InputFileError, match="chunk 7: cannot read"):
        paged_native.native_scatter_source(check, bufs, layout, slots)


@needs_native
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_mapped_payload_cut_short_under_the_copy_is_refused_not_a_crash(tmp_path, threads, monkeypatch):
    """A payload read from a file's mapping (a container file's chunk in kvtool.load) whose file
    another program truncates: the pages past the new end fault (SIGBUS) as the copy reaches them,
    on whichever kernel thread reads them (or in the one-pass checked copy the staged GPU path
    fills its pinned buffers with). The kernel's guard turns that into a refusal, and the next
    copy runs as before."""
    import mmap

    from kvtool.checksum import crc32
    from kvtool.errors import ChecksumMismatch

    monkeypatch.setenv("KVTOOL_THREADS", threads)
    monkeypatch.setattr(paged_native, "MIN_BYTES_PER_THREAD", 1)
    gen = torch.Generator().manual_seed(24)
    L, T, H, D, BS = 2, 256, 4, 64, 16  # 1 MB of float32 KV
    layout = PagedLayout("flash_attn")
    bufs = make_buffers("flash_attn", L, T // BS + 2, BS, H, D, torch.float32, gen)
    slots = shuffled_slots(T, T // BS + 2, BS, gen)
    blob = torch.randn(2, L, T, H * D, generator=gen)
    payload = blob.view(torch.uint8).reshape(-1).numpy().tobytes()
    path = tmp_path / "kv.kvc"
    path.write_bytes(payload)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        view = torch.frombuffer(mapped, dtype=torch.float32).view(blob.shape)
        check = raw_source(tuple(blob.shape), torch.float32, data=mapped, crc=crc32(payload), what="chunk 3",
                           mapped=True)
        assert paged_native.native_scatter_source(check, bufs, layout, slots)  # whole: loaded
        staging = torch.empty(len(payload), dtype=torch.uint8)
        check.copy_into(memoryview(staging.numpy()))  # (the staged GPU path's checked copy)
        os.truncate(path, 8192)  # all but its first two pages gone
        with pytest.raises(ChecksumMismatch, match="chunk 3: the file ends inside the payload"):
            paged_native.native_scatter_source(check, bufs, layout, slots)
        with pytest.raises(ChecksumMismatch, match="chunk 3: the file ends inside the payload"):
            check.copy_into(memoryview(staging.numpy()))
        del view, check
    finally:
        mapped.close()
    out = clone_buffers(bufs, layout)  # the kernel goes on as before
    _, fresh, check = _file_payload(tmp_path, blob.shape, torch.float32, gen)
    assert paged_native.native_scatter_source(check, out, layout, slots)
    check.release()


# An mmap shim for the test below (LD_PRELOAD), for the descriptor KVTOOL_TEST_CUT_FD only: the file
# KVTOOL_TEST_CUT_PATH is cut to KVTOOL_TEST_CUT_TO bytes just after it is mapped, as another
# program could do then; or (KVTOOL_TEST_SHORT_PATH) the mapping is of that shorter file instead,
# so that the pages past its end fault while the file itself is whole: as a page the system
# cannot read (an I/O error under the mapping) does.
_CUT_AFTER_MAP = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);

static void *shimmed(mmap_fn real, void *a, size_t n, int prot, int flags, int fd, off_t off) {
    const char *cut_fd = getenv("KVTOOL_TEST_CUT_FD");
    if (!cut_fd || fd != atoi(cut_fd)) return real(a, n, prot, flags, fd, off);
    const char *shorter = getenv("KVTOOL_TEST_SHORT_PATH");
    if (shorter) {
        int other = open(shorter, O_RDONLY);
        void *map = real(a, n, prot, flags, other, 0);
        close(other);
        return map;
    }
    void *map = real(a, n, prot, flags, fd, off);
    const char *cut_to = getenv("KVTOOL_TEST_CUT_TO"), *path = getenv("KVTOOL_TEST_CUT_PATH");
    if (map != MAP_FAILED && cut_to && path && truncate(path, atoll(cut_to)) != 0) abort();
    return map;
}
void *mmap(void *a, size_t n, int prot, int flags, int fd, off_t off) {
    return shimmed((mmap_fn)dlsym(RTLD_NEXT, "mmap"), a, n, prot, flags, fd, off);
}
void *mmap64(void *a, size_t n, int prot, int flags, int fd, off_t off) {
    return shimmed((mmap_fn)dlsym(RTLD_NEXT, "mmap64"), a, n, prot, flags, fd, off);
}
"""


@needs_native
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_store_payload_cut_short_after_it_is_mapped_is_refused_not_a_crash(tmp_path, threads):
    """A store object's payload read from a mapping, the file cut short by another program right
    after it was mapped (after the size check): the copy faults on the pages that are gone, on
    one or three kernel threads, and the object is refused, in a process that goes on. A fault
    while the file is still whole (a page that cannot be read) is a failed read, not damage."""
    import shutil
    import subprocess
    import sys

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the test's mmap shim")
    (tmp_path / "cut.c").write_text(_CUT_AFTER_MAP)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "cut.so"), str(tmp_path / "cut.c"), "-ldl"],
                   check=True)
    script = f"""
import os, torch
from kvtool.checksum import crc32
from kvtool.chunk_source import ChunkSource
from kvtool.connectors import paged_native
from kvtool.connectors.paged_layout import PagedLayout
from kvtool.errors import ChecksumMismatch, InputFileError
native = paged_native.native_module()
native.map_min_bytes(0)
paged_native.MIN_BYTES_PER_THREAD = 1
L, T, H, D, BS = 2, 1024, 4, 64, 16  # 4 MB of float32 KV
bufs = [torch.zeros(2, T // BS, BS, H, D) for _ in range(L)]
slots = torch.randperm(T // BS)[torch.arange(T) // BS] * BS + torch.arange(T) % BS
blob = torch.randn(2, L, T, H * D)
payload = blob.view(torch.uint8).reshape(-1).numpy().tobytes()
path = {str(tmp_path / "object")!r}
shorter = path + ".short"
with open(shorter, "wb") as f:
    f.write(b"x" * 8192)
for how in ("cut", "whole", "unreadable"):
    with open(path, "wb") as f:
        f.write(b"x" * 100 + payload)
    fd = os.open(path, os.O_RDONLY)
    check = ChunkSource(what="chunk 7", codec="raw", dtype="float32", shape=tuple(blob.shape), length=len(payload),
                        crc32c=crc32(payload), raw=True, decode=None, fd=fd, offset=100)
    os.environ.update(KVTOOL_TEST_CUT_FD=str(fd) if how != "whole" else "-1", KVTOOL_TEST_CUT_TO="8192",
                      KVTOOL_TEST_CUT_PATH=path)
    if how == "unreadable":
        os.environ["KVTOOL_TEST_SHORT_PATH"] = shorter
    maps = native.file_maps()
    try:
        paged_native.native_scatter_source(check, bufs, PagedLayout("flash_attn"), slots)
        print("loaded")
    except ChecksumMismatch as err:
        print("refused:", err)
    except InputFileError as err:
        print("failed read:", err)
    assert native.file_maps() == maps + 1
    check.release()
"""
    env = dict(os.environ, LD_PRELOAD=str(tmp_path / "cut.so"), KVTOOL_THREADS=threads)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["refused: chunk 7: the file ends inside the payload (stored bytes are damaged)",
                                        "loaded", "failed read: chunk 7: cannot read (Input/output error)"]


@needs_native
def test_a_fault_outside_the_guard_still_ends_the_process(tmp_path):
    """The guard answers only for the payload a copy reads: any other SIGBUS (here Python reading
    a mapping whose file was cut short, after the guard is in place) ends the process as before,
    with the handler installed before ours (faulthandler's traceback) run first."""
    import signal
    import subprocess
    import sys

    script = f"""
import faulthandler, mmap, os
faulthandler.enable()
import torch
from kvtool.checksum import crc32
from kvtool.chunk_source import ChunkSource
from kvtool.connectors import paged_native
from kvtool.connectors.paged_layout import PagedLayout
bufs = [torch.zeros(2, 2, 16, 1, 8) for _ in range(2)]
blob = torch.ones(2, 2, 16, 8)
data = memoryview(bytearray(blob.numpy().tobytes()))
source = ChunkSource(what="chunk", codec="raw", dtype="float32", shape=(2, 2, 16, 8), length=len(data),
                     crc32c=crc32(data), raw=True, decode=None, data=data)
assert paged_native.native_scatter_source(source, bufs, PagedLayout("flash_attn"), torch.arange(16))
path = {str(tmp_path / "other")!r}
with open(path, "wb") as f:
    f.write(b"x" * 65536)
with open(path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
os.truncate(path, 0)
print("guard in place; faulting", flush=True)
mapped[40000]
print("survived", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "guard in place" in done.stdout and "survived" not in done.stdout, done.stderr
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)
    assert "Fatal Python error: Bus error" in done.stderr


@needs_native
def test_a_sigbus_sent_to_the_process_goes_where_it_went_without_the_guard():
    """A SIGBUS that someone sends (kill) is not a fault of a guarded copy: the application's own
    handler gets it, or it is ignored where the application ignores it, as without the guard."""
    import subprocess
    import sys

    script = """
import os, signal, torch
from kvtool.checksum import crc32
from kvtool.chunk_source import ChunkSource
from kvtool.connectors import paged_native
from kvtool.connectors.paged_layout import PagedLayout
bufs = [torch.zeros(2, 2, 16, 1, 8) for _ in range(2)]
data = memoryview(bytearray(torch.ones(2, 2, 16, 8).numpy().tobytes()))
source = ChunkSource(what="chunk", codec="raw", dtype="float32", shape=(2, 2, 16, 8), length=len(data),
                     crc32c=crc32(data), raw=True, decode=None, data=data)

def guarded_copy():  # (each call puts the guard's handler back in front of the application's)
    assert paged_native.native_scatter_source(source, bufs, PagedLayout("flash_attn"), torch.arange(16))

got = []
signal.signal(signal.SIGBUS, lambda *_: got.append("handled"))
guarded_copy()
os.kill(os.getpid(), signal.SIGBUS)
signal.signal(signal.SIGBUS, signal.SIG_IGN)
guarded_copy()
os.kill(os.getpid(), signal.SIGBUS)
print(got, "alive", flush=True)
signal.signal(signal.SIGBUS, signal.SIG_DFL)
guarded_copy()
os.kill(os.getpid(), signal.SIGBUS)
print("survived the default action", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["['handled'] alive"], done.stderr
    assert done.returncode == -signal.SIGBUS


def test_a_payload_in_a_file_is_read_whole_and_checked_for_any_other_copy(tmp_path):
    """Paths without the windowed kernel (the torch fallback, the staged GPU path) ask for the
    bytes: they are read whole into a private buffer and checked there (`decode`), or read
    straight into the caller's buffer and checked there (`copy_into`)."""
    from kvtool.errors import ChecksumMismatch

    gen = torch.Generator().manual_seed(23)
    blob, _, check = _file_payload(tmp_path, (2, 2, 40, 16), torch.float32, gen)
    assert torch.equal(check.decode(), blob)
    staging = torch.empty(check.length, dtype=torch.uint8)
    check.copy_into(memoryview(staging.numpy()))
    assert torch.equal(staging.view(torch.float32).view(blob.shape), blob)
    assert "in a file" in repr(check)  # (no read for a repr)
    check.release()
    check.release()  # twice is harmless
    _, _, check = _file_payload(tmp_path, (2, 2, 40, 16), torch.float32, gen, cut=3)
    with pytest.raises(ChecksumMismatch, match="ends inside the payload"):
        check.decode()
    with pytest.raises(ChecksumMismatch, match="ends inside the payload"):
        check.copy_into(memoryview(staging.numpy()))
    check.release()


@needs_native
def test_calls_from_several_threads_and_a_forked_child_share_the_kernel_threads_correctly(monkeypatch):
    """The kernel keeps its worker threads for the next call: calls made at once from several
    Python threads (one uses the workers, the others threads of their own) and a call in a
    forked child (which has no workers until it starts its own) all copy the reference bytes."""
    import threading

    monkeypatch.setenv("KVTOOL_THREADS", "3")
    gen = torch.Generator().manual_seed(31)
    T, BS, L, H, D, NB = 200, 16, 4, 2, 16, 16
    layout = PagedLayout("flash_attn")
    bufs = make_buffers("flash_attn", L, NB, BS, H, D, torch.float32, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    ref = torch.empty(2, L, T, H * D)
    paged_torch.torch_gather(bufs, layout, slots, ref)
    outs = [torch.zeros_like(ref) for _ in range(4)]
    old = native.nontemporal_min(0)  # (every copy large enough for threads: see _threads)
    monkeypatch.setattr(paged_native, "MIN_BYTES_PER_THREAD", 1)
    try:
        def gather(out):
            for _ in range(20):
                assert paged_native.native_gather(bufs, layout, slots, out)

        workers = [threading.Thread(target=gather, args=(out,)) for out in outs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert all(torch.equal(out, ref) for out in outs)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only when its copy is right (no torch op: its OpenMP hangs after a fork)
            out = torch.empty(ref.shape)
            ok = paged_native.native_gather(bufs, layout, slots, out) and out.numpy().tobytes() == ref.numpy().tobytes()
            os._exit(0 if ok else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        native.nontemporal_min(old)


@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, 1), (torch.float16, 2), (torch.float32, 3)])
def test_the_values_check_rides_on_every_crc_path_and_equals_the_reference(dtype, kind):
    """Check 13 in the checked copy and check (kernels/crc32c_cpu.c: the exponent flags OR-ed on the CRC's
    own loads, on every CRC path: table, crc32 instruction, 128- and 256-bit folds) against
    torch.isfinite, for every length around the 64-byte folding unit and a bad value anywhere."""
    module = paged_native.native_module()
    if module is None:
        pytest.skip("kvtool._paged_native is not built")
    best = module.crc32c_level()
    try:
        for level in range(best + 1):
            module.crc32c_set_level(level)
            for n in (1, 31, 32, 33, 64, 65, 1000, 4099):
                for pos in (None, 0, n // 2, n - 1):
                    for value in (float("nan"), float("inf"), -float("inf"), 65504.0 * 4):
                        a = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
                        if pos is not None:
                            a[pos] = value
                        want = bool((~torch.isfinite(a)).any())
                        src = memoryview(a.view(torch.uint8).numpy())
                        dst = bytearray(len(src))
                        crc, bad = module.copy_checked(memoryview(dst), src, kind)
                        assert bytes(dst) == bytes(src) and bool(bad) == want, (level, n, pos, value)
                        assert crc == module.copy_checked(memoryview(bytearray(len(src))), src)
                        in_place = module.checked(src, kind)  # bytes already ours: the same pass, no copy
                        assert in_place[0] == crc and bool(in_place[1]) == want
                        assert module.nonfinite(src, kind) == int((~torch.isfinite(a)).sum())
    finally:
        module.crc32c_set_level(best)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("crc_level", CRC_LEVELS, indirect=True)
def test_many_payloads_in_one_call_are_each_payload_alone(layout, threads, crc_level, nontemporal):
    """scatter_checked_many (a load's run of chunks in one call, their parts shared by the
    threads) writes the reference bytes and says each payload's CRC-32C and non-finite count as
    scatter_checked of that payload alone does, damaged and NaN payloads included."""
    import numpy as np

    gen = torch.Generator().manual_seed(41)
    L, H, D, BS, NB = 3, 2, 32, 16, 20
    sizes = [16, 48, 7, 41, 21]
    T = sum(sizes)
    bufs = make_buffers(layout, L, NB, BS, H, D, torch.bfloat16, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    kv = torch.randn(2, L, T, H * D, generator=gen).to(torch.bfloat16)
    kv[0, 1, 16 + 48 + 3, 5] = float("nan")  # in payload 2
    payloads, at = [], 0
    for n in sizes:
        payloads.append(bytearray(kv[:, :, at:at + n].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()))
        at += n
    payloads[3][100] ^= 0x20  # payload 3 damaged (its CRC no longer the stored one: the caller's check)
    ref, out, alone = (clone_buffers(bufs, layout) for _ in range(3))
    paged_torch.torch_scatter(torch.cat([torch.frombuffer(p, dtype=torch.bfloat16).view(2, L, n, H * D)
                                         for p, n in zip(payloads, sizes)], dim=2), ref, PagedLayout(layout), slots)
    template = paged_native._template(out, PagedLayout(layout), None)
    index = slots.to(torch.int64).contiguous()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    items = np.array([(n, index.data_ptr() + 8 * s) for n, s in zip(sizes, starts)], dtype=np.uint64).tobytes()
    got = native.scatter_checked_many(paged_native._template(out, PagedLayout(layout), None).blob_order, payloads,
                                      threads, items, 1)
    expected = []
    alone_template = paged_native._template(alone, PagedLayout(layout), None)
    for p, n, s in zip(payloads, sizes, starts):
        base = torch.frombuffer(p, dtype=torch.uint8).data_ptr()
        expected.append(native.scatter_checked(alone_template.blob_order, p, 1, base, n, index.data_ptr() + 8 * s, 1))
    assert got == expected
    assert [bad for _, bad in got] == [0, 0, 1, 0, 0]
    assert same_bits(ref, out, layout) and same_bits(ref, alone, layout)  # (a NaN equals nothing)
    assert template.parts == 2 * L


def same_bits(a, b, layout) -> bool:
    """Buffers equal bit for bit (NaN included)."""
    flat = (lambda bufs: [t for pair in bufs for t in pair]) if layout == "kv_tuple" else list
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(flat(a), flat(b)))


@needs_native
def test_many_payloads_refuse_a_bad_item_before_any_write():
    import numpy as np

    gen = torch.Generator().manual_seed(42)
    bufs = make_buffers("flash_attn", 2, 6, 4, 2, 8, torch.float32, gen)
    slots = shuffled_slots(8, 6, 4, gen).to(torch.int64).contiguous()
    segs = paged_native._template(bufs, PagedLayout("flash_attn"), None).blob_order
    good = bytearray(2 * 2 * 4 * 16 * 4)  # 4 tokens of float32 KV
    empty = clone_buffers(bufs, "flash_attn")

    def items(*pairs):
        return np.array(pairs, dtype=np.uint64).tobytes()

    for payloads, its in (([good, bytearray(10)], items((4, slots.data_ptr()), (4, slots.data_ptr() + 32))),  # short
                          ([good, good], items((4, slots.data_ptr()))),  # an item missing
                          ([good], items((5, slots.data_ptr())))):  # more tokens than the payload holds
        with pytest.raises(IndexError):
            native.scatter_checked_many(segs, payloads, 2, its, 1)
    assert buffers_equal(bufs, empty, "flash_attn")  # nothing written
    with pytest.raises(TypeError):
        native.scatter_checked_many(segs, [good, 3], 2, items((4, slots.data_ptr()), (4, slots.data_ptr() + 32)), 1)


@needs_native
def test_many_payloads_one_cut_short_under_the_copy_is_that_ones_refusal(tmp_path):
    """Two chunks mapped from one file, the file then truncated inside the second: the call says
    None for that one (the mapping faulted: refused as cut short), the first loads."""
    import mmap

    import numpy as np

    gen = torch.Generator().manual_seed(43)
    L, T, H, D, BS = 2, 256, 4, 64, 16
    bufs = make_buffers("flash_attn", L, 2 * T // BS + 2, BS, H, D, torch.float32, gen)
    slots = shuffled_slots(2 * T, 2 * T // BS + 2, BS, gen).to(torch.int64).contiguous()
    blob = torch.randn(2, 2, L, T, H * D, generator=gen)
    data = blob.view(torch.uint8).reshape(-1).numpy().tobytes()
    path = tmp_path / "two.kvc"
    path.write_bytes(data)
    half = len(data) // 2
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapped)
    try:
        os.truncate(path, half + 8192)
        segs = paged_native._template(bufs, PagedLayout("flash_attn"), None).blob_order
        its = np.array([(T, slots.data_ptr()), (T, slots.data_ptr() + 8 * T)], dtype=np.uint64).tobytes()
        got = native.scatter_checked_many(segs, [view[:half], view[half:]], 2, its, 3)  # (3: fp32 values)
        from kvtool.checksum import crc32

        assert got[0] == (crc32(data[:half]), 0) and got[1] is None
    finally:
        view.release()
        mapped.close()
