"""Connector layer: paged gather/scatter, nested tuples, errors (real tensors, no mocks).

The reference below reads and writes paged buffers with advanced indexing on
their *logical* dims (block, offset, head), independent of the flat-offset
arithmetic the connectors use.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from kvtool.connectors import (
    ConnectorError,
    ConnectorTarget,
    GPUConnectorInterface,
    MemoryFormat,
    MemoryObj,
    NestedTupleConnector,
    PagedLayout,
    PagedMemConnector,
    PagedMemConnectorV2,
    gather_paged,
    run_offset,
    scatter_paged,
    slot_to_block_offset,
)
from kvtool.errors import KvtoolError
from kvtool.connectors import paged_torch
from kvtool.connectors.paged_layout import channel_stride

LAYOUTS = ["flash_attn", "flashinfer", "vllm", "kv_tuple", "vllm_cpu"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def make_buffers(layout, L, NB, BS, H, D, dtype, gen, fill="randn"):
    def r(*shape):
        if fill == "zeros":
            return torch.zeros(*shape, dtype=dtype)
        return torch.randn(*shape, generator=gen).to(dtype)

    if layout == "flash_attn":
        return [r(2, NB, BS, H, D) for _ in range(L)]
    if layout == "flashinfer":
        return [r(NB, 2, BS, H, D) for _ in range(L)]
    if layout in ("vllm", "vllm_cpu"):
        return [r(NB, H, BS, 2 * D) for _ in range(L)]
    return [(r(NB, BS, H, D), r(NB, BS, H, D)) for _ in range(L)]


def _logical(layer, layout, kv, D):
    """A view of one layer's K or V with dims [NB, BS, H, D]."""
    if layout == "flash_attn":
        return layer[kv]
    if layout == "flashinfer":
        return layer[:, kv]
    if layout == "vllm":
        return layer[..., kv * D:(kv + 1) * D].transpose(1, 2)
    if layout == "vllm_cpu":  # a (block, head) page: K transposed [D, BS], then V [BS, D]
        NB, H, BS = layer.shape[:3]
        page = layer.view(NB, H, BS * 2 * D)
        if kv == 0:
            return page[..., :D * BS].view(NB, H, D, BS).permute(0, 3, 1, 2)
        return page[..., D * BS:].view(NB, H, BS, D).permute(0, 2, 1, 3)
    return layer[kv]


def head_dim_of(kvcaches, layout):
    t = kvcaches[0][0] if layout == "kv_tuple" else kvcaches[0]
    return t.shape[-1] // 2 if layout in ("vllm", "vllm_cpu") else t.shape[-1]


def ref_read(kvcaches, layout, slots, BS):
    """[2, L, T, H, D] read slot by slot through advanced indexing."""
    D = head_dim_of(kvcaches, layout)
    b, o = slots // BS, slots % BS
    return torch.stack(
        [torch.stack([_logical(layer, layout, kv, D)[b, o] for layer in kvcaches]) for kv in (0, 1)]
    )


def ref_write(kvcaches, layout, slots, values, BS):
    """values [2, L, T, H, D] -> slots (in place)."""
    D = head_dim_of(kvcaches, layout)
    b, o = slots // BS, slots % BS
    for kv in (0, 1):
        for li, layer in enumerate(kvcaches):
            _logical(layer, layout, kv, D)[b, o] = values[kv, li].to(_logical(layer, layout, kv, D).dtype)


def clone_buffers(kvcaches, layout):
    if layout == "kv_tuple":
        return [(k.clone(), v.clone()) for k, v in kvcaches]
    return [t.clone() for t in kvcaches]


def buffers_equal(a, b, layout):
    if layout == "kv_tuple":
        return all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(a, b) for x, y in ((ka, kb), (va, vb)))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def shuffled_slots(T, NB, BS, gen, prefix=0):
    """Full slot mapping over a random block table; first `prefix` tokens -1."""
    need = math.ceil(T / BS)
    assert NB >= need
    table = torch.randperm(NB, generator=gen)[:need]
    t = torch.arange(T)
    slots = table[t // BS] * BS + t % BS
    slots[:prefix] = -1
    return slots


def num_blocks_for(T, BS):
    return math.ceil(T / BS) + 3


def paged_case(layout, T, BS, L, H, D, dtype, seed):
    """A connector test's usual start: random buffers in `layout`, a shuffled slot mapping and a
    connector for them (and the generator, to draw more)."""
    gen = torch.Generator().manual_seed(seed)
    NB = num_blocks_for(T, BS)
    bufs = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    return gen, NB, bufs, slots, PagedMemConnectorV2(H * D, L, layout=layout)


def as_blob(values):  # [2, L, T, H, D] -> [2, L, T, H*D]
    return values.reshape(*values.shape[:3], -1)


def paged_round_trip(layout, dtype, T, BS, start, end, prefix=0, seed=0, L=2, H=2, D=8):
    gen = torch.Generator().manual_seed(seed)
    NB = num_blocks_for(T, BS)
    src = make_buffers(layout, L, NB, BS, H, D, dtype, gen)
    slots_a = shuffled_slots(T, NB, BS, gen, prefix)
    conn = PagedMemConnectorV2(H * D, L, layout=layout)
    mo = conn.allocate(end - start, dtype=dtype)
    mo.metadata.fmt = MemoryFormat.UNDEFINED
    conn.from_gpu(mo, start, end, kvcaches=src, slot_mapping=slots_a)
    assert mo.metadata.fmt is MemoryFormat.KV_BLOB
    want = as_blob(ref_read(src, layout, slots_a[start:end], BS))
    assert torch.equal(mo.tensor, want)

    NB2 = NB + 2
    dst = make_buffers(layout, L, NB2, BS, H, D, dtype, gen)
    slots_b = shuffled_slots(T, NB2, BS, gen, prefix)
    expected = clone_buffers(dst, layout)
    ref_write(expected, layout, slots_b[start:end], mo.tensor.view(2, L, end - start, H, D), BS)
    conn.to_gpu(mo, start, end, kvcaches=dst, slot_mapping=slots_b)
    # every written slot reproduced exactly, every other slot untouched
    assert buffers_equal(dst, expected, layout)
    assert torch.equal(ref_read(dst, layout, slots_b[start:end], BS), ref_read(src, layout, slots_a[start:end], BS))


# ---------------------------------------------------------------------------
# paged round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,BS", [(1, 16), (7, 3), (100, 16), (257, 128), (700, 17)])
def test_paged_round_trip_whole(layout, dtype, T, BS):
    paged_round_trip(layout, dtype, T, BS, 0, T)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_round_trip_chunks(layout):
    T, BS = 613, 16
    for start, end in [(0, 256), (256, 512), (512, 613), (5, 6), (300, 301)]:
        paged_round_trip(layout, torch.bfloat16, T, BS, start, end, seed=start)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    T=st.integers(1, 700),
    BS=st.sampled_from([1, 2, 3, 5, 16, 17, 128]),
    data=st.data(),
)
def test_paged_round_trip_property(layout, dtype, T, BS, data):
    prefix = data.draw(st.integers(0, T - 1), label="prefix")
    start = data.draw(st.integers(prefix, T - 1), label="start")
    end = data.draw(st.integers(start + 1, T), label="end")
    paged_round_trip(layout, dtype, T, BS, start, end, prefix=prefix, seed=T * 131 + BS, L=2, H=2, D=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_cached_slots(layout):
    T, BS, prefix = 50, 8, 20
    paged_round_trip(layout, torch.float16, T, BS, prefix, T, prefix=prefix)
    gen = torch.Generator().manual_seed(1)
    NB = num_blocks_for(T, BS)
    bufs = make_buffers(layout, 2, NB, BS, 2, 8, torch.float16, gen)
    slots = shuffled_slots(T, NB, BS, gen, prefix)
    conn = PagedMemConnectorV2(16, 2, layout=layout)
    for start in (0, prefix - 1):
        mo = conn.allocate(T - start, torch.float16)
        with pytest.raises(ValueError, match="-1"):
            conn.from_gpu(mo, start, T, kvcaches=bufs, slot_mapping=slots)
        with pytest.raises(ValueError, match="-1"):
            conn.to_gpu(mo, start, T, kvcaches=bufs, slot_mapping=slots)


def test_v1_paged_round_trip():
    gen = torch.Generator().manual_seed(2)
    T, BS, L, H, D = 300, 16, 3, 2, 8
    NB = num_blocks_for(T, BS)
    src = make_buffers("kv_tuple", L, NB, BS, H, D, torch.bfloat16, gen)
    slots = shuffled_slots(T, NB, BS, gen)
    conn = PagedMemConnector(H * D, L, num_kv_heads=H, head_dim=D)
    mo = conn.allocate(T - 40, torch.bfloat16)
    conn.from_gpu(mo, 40, T, kvcaches=src, slot_mapping=slots)
    assert torch.equal(mo.tensor, as_blob(ref_read(src, "kv_tuple", slots[40:], BS)))
    dst = make_buffers("kv_tuple", L, NB, BS, H, D, torch.bfloat16, gen, fill="zeros")
    slots2 = shuffled_slots(T, NB, BS, gen)
    conn.to_gpu(mo, 40, T, kvcaches=dst, slot_mapping=slots2)
    assert torch.equal(ref_read(dst, "kv_tuple", slots2[40:], BS), ref_read(src, "kv_tuple", slots[40:], BS))


# ---------------------------------------------------------------------------
# cross-layout equivalence, strided buffers, dtype conversion
# ---------------------------------------------------------------------------


def test_cross_layout_equivalence():
    gen = torch.Generator().manual_seed(3)
    T, BS, L, H, D = 203, 16, 3, 3, 8
    NB = num_blocks_for(T, BS)
    logical = torch.randn(2, L, NB * BS, H, D, generator=gen).to(torch.bfloat16)
    all_slots = torch.arange(NB * BS)
    slots = shuffled_slots(T, NB, BS, gen)
    blobs = {}
    bufs = {}
    for layout in LAYOUTS:
        b = make_buffers(layout, L, NB, BS, H, D, torch.bfloat16, gen, fill="zeros")
        ref_write(b, layout, all_slots, logical, BS)
        conn = PagedMemConnectorV2(H * D, L, layout=layout)
        mo = conn.allocate(T, torch.bfloat16)
        conn.from_gpu(mo, 0, T, kvcaches=b, slot_mapping=slots)
        blobs[layout], bufs[layout] = mo, b
    want = as_blob(logical[:, :, slots])
    for layout in LAYOUTS:
        assert torch.equal(blobs[layout].tensor, want), layout
    # written through one layout, read back through another
    for x in LAYOUTS:
        for y in LAYOUTS:
            dst = make_buffers(y, L, NB, BS, H, D, torch.bfloat16, gen, fill="zeros")
            cx, cy = PagedMemConnectorV2(H * D, L, layout=x), PagedMemConnectorV2(H * D, L, layout=y)
            cy.to_gpu(blobs[x], 0, T, kvcaches=dst, slot_mapping=slots)
            back = cx.allocate(T, torch.bfloat16)
            cy.from_gpu(back, 0, T, kvcaches=dst, slot_mapping=slots)
            assert torch.equal(back.tensor, want), (x, y)


def _strided_cases(L, NB, BS, H, D, gen):
    """(name, layout, buffers) whose tensors are views with non-standard strides."""
    def r(*s):
        return torch.randn(*s, generator=gen)

    big = r(L, 2, NB, BS, H, D)
    yield "flash_attn view into an all-layer tensor", "flash_attn", [big[i] for i in range(L)]
    yield "vllm physically [NB, BS, H, 2D]", "vllm", [r(NB, BS, H, 2 * D).permute(0, 2, 1, 3) for _ in range(L)]
    yield "kv_tuple heads-major", "kv_tuple", [
        (r(NB, H, BS, D).permute(0, 2, 1, 3), r(NB, H, BS, D).permute(0, 2, 1, 3)) for _ in range(L)
    ]
    yield "kv_tuple strided channels", "kv_tuple", [(r(NB, BS, H, 2 * D)[..., ::2], r(NB, BS, H, 2 * D)[..., 1::2]) for _ in range(L)]
    yield "flashinfer padded heads (unaligned)", "flashinfer", [r(NB, 2, BS, H, D + 4)[..., :D] for _ in range(L)]
    yield "flash_attn padded heads (aligned)", "flash_attn", [r(2, NB, BS, H, 2 * D)[..., :D] for _ in range(L)]


def test_non_contiguous_buffers():
    gen = torch.Generator().manual_seed(4)
    T, BS, L, H, D = 77, 8, 2, 3, 8
    NB = num_blocks_for(T, BS)
    for name, layout, bufs in _strided_cases(L, NB, BS, H, D, gen):
        slots = shuffled_slots(T, NB, BS, gen)
        conn = PagedMemConnectorV2(H * D, L, layout=layout)
        mo = conn.allocate(T, torch.float32)
        conn.from_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots)
        assert torch.equal(mo.tensor, as_blob(ref_read(bufs, layout, slots, BS))), name
        slots2 = shuffled_slots(T, NB, BS, gen)
        before = clone_buffers(bufs, layout)
        expected = clone_buffers(bufs, layout)
        ref_write(expected, layout, slots2, mo.tensor.view(2, L, T, H, D), BS)
        conn.to_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots2)
        assert buffers_equal(bufs, expected, layout), name
        assert not buffers_equal(bufs, before, layout), name
    # the padding of a view is never written
    base = torch.randn(NB, 2, BS, H, D + 4, generator=gen)
    pad = base[..., D:].clone()
    conn = PagedMemConnectorV2(H * D, 1, layout="flashinfer")
    mo = conn.allocate(T, torch.float32)
    mo.tensor.fill_(7.0)
    conn.to_gpu(mo, 0, T, kvcaches=[base[..., :D]], slot_mapping=shuffled_slots(T, NB, BS, gen))
    assert torch.equal(base[..., D:], pad)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtype_conversion(layout):
    T, BS, L, H, D = 40, 16, 2, 2, 8
    gen, NB, bufs, slots, conn = paged_case(layout, T, BS, L, H, D, torch.bfloat16, seed=5)
    mo = conn.allocate(T, torch.float32)
    conn.from_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots)
    assert torch.equal(mo.tensor, as_blob(ref_read(bufs, layout, slots, BS)).float())
    mo.tensor.add_(torch.rand(mo.tensor.shape, generator=gen) * 1e-3)  # not bf16-representable
    conn.to_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots)
    assert torch.equal(as_blob(ref_read(bufs, layout, slots, BS)), mo.tensor.to(torch.bfloat16))


# ---------------------------------------------------------------------------
# nested tuple
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["THD", "T(HD)", "HF"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blob", ["float32", "the buffers' dtype"])  # converted by torch / copied natively
def test_nested_tuple_round_trip(form, dtype, blob):
    gen = torch.Generator().manual_seed(6)
    T, L, H, D = 131, 3, 3, 8

    def make(zero=False):
        shape = {"THD": (T, H, D), "T(HD)": (T, H * D), "HF": (1, H, T, D)}[form]
        mk = (lambda: torch.zeros(shape, dtype=dtype)) if zero else (lambda: torch.randn(shape, generator=gen).to(dtype))
        return tuple((mk(), mk()) for _ in range(L))

    def tokens(t):  # -> [T, H*D]
        return t[0].transpose(0, 1).reshape(T, -1) if form == "HF" else t.reshape(T, -1)

    src = make()
    conn = NestedTupleConnector(H * D, L)
    assert conn.get_shape(5) == torch.Size([2, L, 5, H * D])
    start, end = 17, 100
    mo = conn.allocate(end - start, dtype=torch.float32 if blob == "float32" else dtype)
    conn.from_gpu(mo, start, end, kvcaches=src)
    want = torch.stack([torch.stack([tokens(layer[kv])[start:end] for layer in src]) for kv in (0, 1)])
    assert torch.equal(mo.tensor, want.to(mo.tensor.dtype))
    dst = make(zero=True)
    conn.to_gpu(mo, start, end, kvcaches=dst)
    for ls, ld in zip(src, dst):
        for kv in (0, 1):
            got = tokens(ld[kv])
            assert torch.equal(got[start:end], tokens(ls[kv])[start:end])
            assert not got[:start].any() and not got[end:].any()


@pytest.mark.parametrize("form", ["THD", "HF"])
def test_nested_tuple_checks_stored_bytes_as_it_loads_them(form):
    """A stored chunk not checked yet (a ChunkSource): loaded when its bytes match, refused
    (ChecksumMismatch) when one byte differs."""
    from fixtures import raw_source
    from kvtool.checksum import crc32
    from kvtool.errors import ChecksumMismatch

    gen = torch.Generator().manual_seed(13)
    T, L, H, D = 40, 2, 2, 32
    shape = (T, H, D) if form == "THD" else (1, H, T, D)
    conn = NestedTupleConnector(H * D, L)
    values = torch.randn(conn.get_shape(T), generator=gen)
    payload = bytearray(values.numpy().tobytes())
    check = raw_source(tuple(values.shape), torch.float32, data=payload, crc=crc32(payload), what="chunk 0")
    dst = tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(L))
    conn.to_gpu_source(check, 0, T, kvcaches=dst)
    back = conn.allocate(T, torch.float32)
    conn.from_gpu(back, 0, T, kvcaches=dst)
    assert torch.equal(back.tensor, values)
    payload[len(payload) // 2] ^= 1
    with pytest.raises(ChecksumMismatch, match="chunk 0"):
        conn.to_gpu_source(check, 0, T, kvcaches=dst)


def test_nested_tuple_errors():
    conn = NestedTupleConnector(16, 2)
    kv = tuple((torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)) for _ in range(2))
    mo = conn.allocate(4, torch.float32)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(mo, 0, 4)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.to_gpu(mo, 0, 4)
    with pytest.raises(ValueError, match="past"):
        conn.from_gpu(conn.allocate(4), 8, 12, kvcaches=kv)
    with pytest.raises(ValueError, match="layers"):
        conn.from_gpu(mo, 0, 4, kvcaches=kv[:1])
    with pytest.raises(ValueError, match="channels"):
        conn.from_gpu(mo, 0, 4, kvcaches=tuple((torch.zeros(10, 3, 8), torch.zeros(10, 3, 8)) for _ in range(2)))
    with pytest.raises(ValueError, match="KV_BLOB"):
        conn.to_gpu(MemoryObj.from_tensor(mo.tensor, MemoryFormat.UNDEFINED), 0, 4, kvcaches=kv)
    with pytest.raises(ValueError, match="no tensor"):
        conn.to_gpu(MemoryObj(None, mo.metadata), 0, 4, kvcaches=kv)
    with pytest.raises(ValueError, match="shape"):
        conn.to_gpu(mo, 0, 5, kvcaches=kv)


# ---------------------------------------------------------------------------
# documented errors of the paged connectors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_errors(layout):
    T, BS, L, H, D = 30, 4, 2, 2, 8
    gen, NB, bufs, slots, conn = paged_case(layout, T, BS, L, H, D, torch.float16, seed=7)
    mo = conn.allocate(10, torch.float16)
    ok = dict(kvcaches=bufs, slot_mapping=slots)

    for op in (conn.from_gpu, conn.to_gpu):
        with pytest.raises(ValueError, match="kvcaches"):
            op(mo, 0, 10, slot_mapping=slots)
        with pytest.raises(ValueError, match="slot_mapping"):
            op(mo, 0, 10, kvcaches=bufs)
        with pytest.raises(ValueError, match="KV_BLOB"):
            op(MemoryObj.from_tensor(mo.tensor, MemoryFormat.BINARY), 0, 10, **ok)
        with pytest.raises(ValueError, match="no tensor"):
            op(MemoryObj(None, mo.metadata), 0, 10, **ok)
        with pytest.raises(ValueError, match="shape"):
            op(conn.allocate(11, torch.float16), 0, 10, **ok)
        with pytest.raises(ValueError, match="shape"):
            op(MemoryObj.from_tensor(torch.zeros(2, L, 10, H * D + 1, dtype=torch.float16)), 0, 10, **ok)
        with pytest.raises(ValueError, match="dtype"):
            op(MemoryObj.from_tensor(torch.zeros(conn.get_shape(10), dtype=torch.float64)), 0, 10, **ok)
        with pytest.raises(ValueError, match="dtype"):
            op(MemoryObj.from_tensor(torch.zeros(conn.get_shape(10), dtype=torch.int8)), 0, 10, **ok)
        with pytest.raises(ValueError, match="device"):
            op(MemoryObj.from_tensor(torch.empty(conn.get_shape(10), dtype=torch.float16, device="meta")), 0, 10, **ok)
        with pytest.raises(ValueError, match="contiguous"):
            op(MemoryObj.from_tensor(torch.zeros(2, L, 10, 2 * H * D, dtype=torch.float16)[..., ::2]), 0, 10, **ok)
        with pytest.raises(ValueError, match="too short"):
            op(mo, 20, 30, kvcaches=bufs, slot_mapping=slots[:25])
        bad = slots.clone()
        bad[5] = -1
        with pytest.raises(ValueError, match=r"slot_mapping\[5\] is -1"):
            op(mo, 0, 10, kvcaches=bufs, slot_mapping=bad)
        op(mo, 10, 20, kvcaches=bufs, slot_mapping=bad)  # -1 outside the range is fine
        bad[5] = -3
        with pytest.raises(ValueError, match="negative"):
            op(mo, 0, 10, kvcaches=bufs, slot_mapping=bad)
        bad[5] = NB * BS
        with pytest.raises(ValueError, match="out of range"):
            op(mo, 0, 10, kvcaches=bufs, slot_mapping=bad)
        with pytest.raises(ValueError, match="integer"):
            op(mo, 0, 10, kvcaches=bufs, slot_mapping=slots.float())
        with pytest.raises(ValueError, match="1-D"):
            op(mo, 0, 10, kvcaches=bufs, slot_mapping=slots.view(1, -1))
        for start, end in [(-1, 9), (5, 5), (6, 5), (0.0, 10), (0, "10"), (True, 10)]:
            with pytest.raises(ValueError, match="start"):
                op(mo, start, end, **ok)
        with pytest.raises(ValueError, match="layers"):
            op(mo, 0, 10, kvcaches=bufs[:1], slot_mapping=slots)
        with pytest.raises(ValueError, match="hidden_dim_size"):
            PagedMemConnectorV2(H * D * 2, L, layout=layout).from_gpu(
                MemoryObj.from_tensor(torch.zeros(2, L, 10, 2 * H * D, dtype=torch.float16)), 0, 10, **ok
            )
        with pytest.raises(ValueError, match="expects|one tensor"):
            wrong = "flash_attn" if layout in ("vllm", "vllm_cpu") else "vllm"  # (those two share a shape)
            PagedMemConnectorV2(H * D, L, layout=wrong).from_gpu(mo, 0, 10, **ok)
        with pytest.raises(ValueError, match="use_gpu"):
            PagedMemConnectorV2(H * D, L, layout=layout, use_gpu=True).from_gpu(mo, 0, 10, **ok)
    dup = slots.clone()
    dup[3] = dup[4]
    with pytest.raises(ValueError, match="repeats"):
        conn.to_gpu(mo, 0, 10, kvcaches=bufs, slot_mapping=dup)
    conn.from_gpu(mo, 0, 10, kvcaches=bufs, slot_mapping=dup)  # reading a slot twice is fine
    # python list slot mappings are accepted
    conn.from_gpu(mo, 0, 10, kvcaches=bufs, slot_mapping=slots.tolist())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffers_checked_once_are_checked_again_when_they_change(layout):
    """A connector checks and maps the buffers once and reuses that while their addresses,
    shapes and strides stay the same: a layer swapped for another tensor is written there, one of
    another shape or dtype or a wrong layer count is refused as on the first call."""
    T, BS, L, H, D = 24, 4, 3, 2, 8
    gen, NB, bufs, slots, conn = paged_case(layout, T, BS, L, H, D, torch.float32, seed=11)
    mo = conn.allocate(T, torch.float32)
    mo.tensor.copy_(torch.randn(mo.tensor.shape, generator=gen))
    conn.to_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots)  # checked and mapped
    swapped = list(bufs)
    swapped[1] = make_buffers(layout, 1, NB, BS, H, D, torch.float32, gen, fill="zeros")[0]
    old_layer = clone_buffers(bufs, layout)[1]
    mo.tensor.copy_(torch.randn(mo.tensor.shape, generator=gen))  # new values: the old layer must not get them
    conn.to_gpu(mo, 0, T, kvcaches=swapped, slot_mapping=slots)
    # read back by the reference (not through the connector's cached maps): the new tensor holds them
    assert torch.equal(as_blob(ref_read(swapped, layout, slots, BS)), mo.tensor)
    assert buffers_equal([old_layer], [bufs[1]], layout)  # and the tensor it replaced was not written
    back = conn.allocate(T, torch.float32)
    conn.from_gpu(back, 0, T, kvcaches=swapped, slot_mapping=slots)
    assert torch.equal(back.tensor, mo.tensor)
    for wrong, match in ((make_buffers(layout, 1, NB + 1, BS, H, D, torch.float32, gen)[0], "layer 1"),
                         (make_buffers(layout, 1, NB, BS, H, D, torch.float16, gen)[0], "layer 1")):
        changed = list(bufs)
        changed[1] = wrong
        with pytest.raises(ValueError, match=match):
            conn.to_gpu(mo, 0, T, kvcaches=changed, slot_mapping=slots)
    with pytest.raises(ValueError, match="layers"):
        conn.to_gpu(mo, 0, T, kvcaches=bufs[:2], slot_mapping=slots)
    conn.to_gpu(mo, 0, T, kvcaches=bufs, slot_mapping=slots)  # the first buffers again: fine


def test_constructor_and_layer_errors():
    with pytest.raises(ValueError, match="unknown paged layout"):
        PagedMemConnectorV2(16, 2, layout="paged")
    with pytest.raises(ValueError, match="hidden_dim_size"):
        PagedMemConnectorV2(16, 2, num_kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="num_layers"):
        NestedTupleConnector(16, 0)
    with pytest.raises(TypeError):
        PagedMemConnectorV2(16, 2, layouts="vllm")
    conn = PagedMemConnectorV2(16, 2, layout="kv_tuple", num_kv_heads=4, head_dim=4)
    bufs = make_buffers("kv_tuple", 2, 4, 4, 2, 8, torch.float32, None, fill="zeros")
    with pytest.raises(ValueError, match="KV heads"):
        conn.from_gpu(conn.allocate(2, torch.float32), 0, 2, kvcaches=bufs, slot_mapping=[0, 1])
    conn = PagedMemConnectorV2(16, 2, layout="flash_attn")
    mixed = [torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)]
    with pytest.raises(ValueError, match="layer 1"):
        conn.from_gpu(conn.allocate(2, torch.float32), 0, 2, kvcaches=mixed, slot_mapping=[0, 1])
    with pytest.raises(ValueError, match="one tensor"):
        conn.from_gpu(conn.allocate(2, torch.float32), 0, 2, kvcaches=[(mixed[0], mixed[0])] * 2, slot_mapping=[0, 1])
    with pytest.raises(ValueError, match=r"\(K, V\) pair"):
        PagedMemConnector(16, 2).from_gpu(conn.allocate(2, torch.float32), 0, 2, kvcaches=mixed, slot_mapping=[0, 1])
    # a ConnectorError is both a ValueError and a kvtool error (one-line CLI message)
    assert issubclass(ConnectorError, ValueError) and issubclass(ConnectorError, KvtoolError)


def test_get_shape_and_interface():
    for conn in (NestedTupleConnector(192, 30), PagedMemConnector(192, 30), PagedMemConnectorV2(192, 30, layout="vllm")):
        assert isinstance(conn, GPUConnectorInterface)
        assert conn.get_shape(256) == torch.Size([2, 30, 256, 192])
        assert conn.get_shape(0) == torch.Size([2, 30, 0, 192])
        with pytest.raises(ValueError):
            conn.get_shape(-1)
    with pytest.raises(TypeError):
        GPUConnectorInterface(16, 2)  # abstract


# ---------------------------------------------------------------------------
# index arithmetic and the kernel boundary
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_run_offset_matches_tensor_addressing(layout):
    """run_offset (the C-header formula) and channel_stride point at the same elements as logical
    indexing."""
    gen = torch.Generator().manual_seed(8)
    NB, BS, H, D = 5, 3, 2, 4
    bufs = make_buffers(layout, 1, NB, BS, H, D, torch.float32, gen)
    tensors = bufs[0] if layout == "kv_tuple" else (bufs[0], bufs[0])
    for slot in range(NB * BS):
        block, off = slot_to_block_offset(slot, BS)
        assert block * BS + off == slot
        for kv in (0, 1):
            t = tensors[kv]
            flat = t.reshape(-1)
            step = channel_stride(PagedLayout(layout), kv, t.stride(), BS)
            for h in range(H):
                base = run_offset(PagedLayout(layout), kv, block, off, h, t.stride(), D)
                want = _logical(bufs[0], layout, kv, D)[block, off, h]
                assert torch.equal(flat[base:base + D * step:step], want)


def test_connectors_copy_through_the_one_dispatch(monkeypatch):
    """Connectors go through gather_paged/scatter_paged, which run the native row copy for CPU
    buffers (the torch reference where it is not built)."""
    from kvtool.connectors import paged_native, paged_torch

    calls = []

    def recording(module, name):
        original = getattr(module, name)

        def call(*args):
            calls.append(name)
            return original(*args)
        monkeypatch.setattr(module, name, call)

    for module, name in ((paged_torch, "torch_gather"), (paged_torch, "torch_scatter"),
                         (paged_native, "native_gather"), (paged_native, "native_scatter")):
        recording(module, name)
    paged_round_trip("vllm", torch.float32, 20, 4, 0, 20)
    if paged_native.native_module() is not None:
        assert calls == ["native_gather", "native_scatter"]
    else:
        assert calls == ["native_gather", "torch_gather", "native_scatter", "torch_scatter"]
    # and the functions are usable directly
    gen = torch.Generator().manual_seed(9)
    bufs = make_buffers("flashinfer", 2, 4, 4, 2, 4, torch.float16, gen)
    slots = torch.tensor([3, 9, 0, 15])
    out = torch.empty(2, 2, 4, 8, dtype=torch.float16)
    gather_paged(bufs, "flashinfer", slots, out)
    fresh = make_buffers("flashinfer", 2, 4, 4, 2, 4, torch.float16, gen, fill="zeros")
    scatter_paged(out, fresh, PagedLayout.FLASHINFER, slots)
    assert torch.equal(ref_read(fresh, "flashinfer", slots, 4), ref_read(bufs, "flashinfer", slots, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "vllm_cpu"])  # a host layout
def test_use_gpu_path(layout):
    gen = torch.Generator().manual_seed(10)
    T, BS, L, H, D = 300, 16, 2, 2, 8
    NB = num_blocks_for(T, BS)
    bufs = make_buffers(layout, L, NB, BS, H, D, torch.bfloat16, gen)
    slots = shuffled_slots(T, NB, BS, gen, prefix=17)
    cuda = [tuple(x.cuda() for x in b) if layout == "kv_tuple" else b.cuda() for b in bufs]
    conn = PagedMemConnectorV2(H * D, L, use_gpu=True, layout=layout, chunk_size=256)
    mo = conn.allocate(T - 17, torch.bfloat16, pin_memory=True)
    conn.from_gpu(mo, 17, T, kvcaches=cuda, slot_mapping=slots.cuda())
    assert torch.equal(mo.tensor, as_blob(ref_read(bufs, layout, slots[17:], BS)))
    fresh = [tuple(torch.zeros_like(x) for x in b) if layout == "kv_tuple" else torch.zeros_like(b) for b in cuda]
    conn.to_gpu(mo, 17, T, kvcaches=fresh, slot_mapping=slots)
    assert torch.equal(ref_read(fresh, layout, slots[17:].cuda(), BS).cpu(), ref_read(bufs, layout, slots[17:], BS))


def test_vllm_cpu_layout_is_the_page_vllm_cpu_writes():
    """vLLM 0.32's CPU backend (docs/vllm-cpu-0.32-notes.md, measured there against transformers'
    K/V): a layer is [num_blocks, H, block, 2*D]; the page of (block b, head h) holds K transposed,
    element (c, t) at c*block + t, then V, element (t, c) at block*D + t*D + c. Filled by that flat
    formula, the gather must give K[c] = encode(0, ...) and V[c] = encode(1, ...)."""
    NB, H, BS, D, L = 3, 2, 4, 8, 1
    layer = torch.empty(NB, H, BS, 2 * D)
    page = layer.view(NB, H, BS * 2 * D)

    def code(kv, b, h, t, c):
        return float(kv * 100000 + b * 10000 + h * 1000 + t * 10 + c)
    for b in range(NB):
        for h in range(H):
            for t in range(BS):
                for c in range(D):
                    page[b, h, c * BS + t] = code(0, b, h, t, c)
                    page[b, h, BS * D + t * D + c] = code(1, b, h, t, c)
    slots = torch.tensor([1 * BS + 2, 2 * BS + 0, 0 * BS + 3])  # tokens in blocks 1, 2, 0
    out = torch.empty(2, L, 3, H * D)
    gather_paged([layer], "vllm_cpu", slots, out)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, BS)
        for kv in (0, 1):
            want = [code(kv, b, h, t, c) for h in range(H) for c in range(D)]
            assert out[kv, 0, i].tolist() == want
    # and back: a scatter into a fresh layer rebuilds those pages exactly
    fresh = torch.zeros_like(layer)
    scatter_paged(out, [fresh], "vllm_cpu", slots)
    for slot in slots.tolist():
        b, t = divmod(slot, BS)
        assert torch.equal(fresh[b].view(H, -1)[:, [c * BS + t for c in range(D)]],
                           layer[b].view(H, -1)[:, [c * BS + t for c in range(D)]])
    with pytest.raises(ValueError, match="contiguous"):
        gather_paged([layer.transpose(1, 2).contiguous().transpose(1, 2)], "vllm_cpu", slots, out)


def _amx_logical(layer, kv):
    """A view of one "vllm_cpu_amx" layer's K or V with dims [NB, BS, H, D], by tile views (not
    amx_page_offset's arithmetic): K's page part is [BS/16, D/2, 16, 2] (16-token tiles of channel
    pairs), V's [D/16, BS/2, 16, 2] (16-channel tiles of token pairs)."""
    NB, H, BS, D = *layer.shape[:3], layer.shape[3] // 2
    part = layer.view(NB, H, 2, BS * D)[:, :, kv]
    if kv == 0:
        tiles = part.view(NB, H, BS // 16, D // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)  # [NB, BS/16, 16, H, D/2, 2]
        return tiles.reshape(NB, BS, H, D)
    tiles = part.view(NB, H, D // 16, BS // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)  # [NB, BS/2, 2, H, D/16, 16]
    return tiles.reshape(NB, BS, H, D)


@pytest.mark.parametrize("NB,H,BS,D", [(3, 1, 32, 64), (5, 2, 64, 128), (4, 3, 128, 64), (2, 2, 32, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_cpu_amx_layout_reads_and_writes_vllms_amx_tiles(NB, H, BS, D, dtype):
    """vLLM 0.32's CPU pages for isa "amx" (measured against vLLM in tests/test_vllm_keys.py):
    gather gives each token's K and V out of the tiles, whatever the slot order, on both the native
    entry point (which hands this layout to the torch reference) and the torch reference; scatter
    into fresh pages rebuilds exactly the written slots and nothing else."""
    gen = torch.Generator().manual_seed(NB * 1000 + BS + D)
    L = 2
    layers = [torch.randn(NB, H, BS, 2 * D, generator=gen).to(dtype) for _ in range(L)]
    T = NB * BS - 5
    slots = torch.randperm(NB * BS, generator=gen)[:T]  # out of order, across every block
    b, o = slots // BS, slots % BS
    want = torch.stack([torch.stack([_amx_logical(layer, kv)[b, o].reshape(T, H * D) for layer in layers])
                        for kv in (0, 1)])
    out = torch.empty(2, L, T, H * D, dtype=dtype)
    gather_paged(layers, "vllm_cpu_amx", slots, out)
    assert torch.equal(out, want)
    reference = torch.empty_like(out)
    paged_torch.torch_gather(layers, PagedLayout.VLLM_CPU_AMX, slots, reference)
    assert torch.equal(reference, want)
    fresh = [torch.zeros_like(layer) for layer in layers]
    scatter_paged(out, fresh, "vllm_cpu_amx", slots)
    for layer, got in zip(layers, fresh):
        for kv in (0, 1):
            assert torch.equal(_amx_logical(got, kv)[b, o], _amx_logical(layer, kv)[b, o])
        unwritten = torch.ones(NB * BS, dtype=torch.bool)
        unwritten[slots] = False
        for kv in (0, 1):
            assert not _amx_logical(got, kv).reshape(NB * BS, -1)[unwritten].any()


def test_vllm_cpu_amx_layout_refuses_pages_vllm_never_tiles():
    """Only what vLLM lays out in AMX tiles (block size and head dim multiples of 32, contiguous
    pages) is taken: anything else is one clear error, not a wrong read."""
    slots = torch.arange(4)
    with pytest.raises(KvtoolError, match="multiples of 32, got 16 and 64"):
        gather_paged([torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)], "vllm_cpu_amx", slots,
                     torch.empty(2, 1, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(KvtoolError, match="multiples of 32, got 32 and 48"):
        gather_paged([torch.zeros(2, 1, 32, 96, dtype=torch.bfloat16)], "vllm_cpu_amx", slots,
                     torch.empty(2, 1, 4, 48, dtype=torch.bfloat16))
    strided = torch.zeros(2, 32, 1, 128, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(KvtoolError, match="'vllm_cpu_amx' needs each \\(block, head\\) page contiguous"):
        gather_paged([strided], "vllm_cpu_amx", slots, torch.empty(2, 1, 4, 64, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------
# the public connectors as a user of LMCache's contract calls them, and kvtool's tensor calls
# ---------------------------------------------------------------------------


def test_lmcaches_paged_and_nested_connectors_as_a_user_calls_them():
    """LMCache's documented usage (VLLMPagedMemGPUConnector, VLLMNestedTupleGPUConnector): allocate
    a KV_BLOB memory object, `from_gpu` fills it (format set to KV_BLOB), `to_gpu` puts it back; a
    missing `kvcaches` or `slot_mapping` is a ValueError. kvtool's `gather` / `scatter` do the same
    with the tensor itself."""
    L, H, D, NB, BS, T = 2, 2, 4, 6, 4, 10
    paged = [(torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, D)) for _ in range(L)]
    slots = torch.tensor([5, 4, 20, 21, 22, 23, 8, 9, 10, 11])
    nested = tuple((torch.randn(T, H, D), torch.randn(T, H, D)) for _ in range(L))
    for conn, kwargs in ((PagedMemConnector(H * D, L), dict(kvcaches=paged, slot_mapping=slots)),
                         (NestedTupleConnector(H * D, L), dict(kvcaches=nested))):
        memory = conn.allocate(T, torch.float32)
        memory.metadata.fmt = MemoryFormat.UNDEFINED
        conn.from_gpu(memory, 0, T, **kwargs)
        assert memory.metadata.fmt is MemoryFormat.KV_BLOB and memory.tensor.shape == conn.get_shape(T)
        blob = torch.empty(conn.get_shape(T))
        conn.gather(blob, 0, T, **kwargs)
        assert torch.equal(blob, memory.tensor)
        doubled = MemoryObj.from_tensor(memory.tensor * 2)
        conn.to_gpu(doubled, 0, T, **kwargs)
        conn.gather(blob, 0, T, **kwargs)
        assert torch.equal(blob, memory.tensor * 2)
        conn.scatter(memory.tensor, 0, T, **kwargs)
        conn.from_gpu(doubled, 0, T, **kwargs)
        assert torch.equal(doubled.tensor, memory.tensor)
        with pytest.raises(ValueError, match="kvcaches"):
            conn.to_gpu(memory, 0, T, **{k: v for k, v in kwargs.items() if k != "kvcaches"})
    with pytest.raises(ValueError, match="slot_mapping"):
        PagedMemConnector(H * D, L).from_gpu(memory, 0, T, kvcaches=paged)


def test_a_connector_of_lmcaches_contract_alone_gets_gather_scatter_and_loads():
    """A connector written against LMCache's contract only (from_gpu / to_gpu with MemoryObj) is
    still a load's destination: `gather` / `scatter` and `ConnectorTarget` hand it memory objects."""
    from kvtool.chunk_source import ChunkSource
    from kvtool.load import ChunkTask, load

    class Theirs(GPUConnectorInterface):
        def __init__(self):
            super().__init__(4, 1)
            self.kv = torch.zeros(2, 1, 8, 4)

        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.copy_(self.kv[:, :, start:end])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            assert isinstance(memory_obj, MemoryObj)
            self.kv[:, :, start:end] = memory_obj.tensor

    conn = Theirs()
    kv = torch.randn(2, 1, 8, 4)
    outcome = load([ChunkTask(0, 8, lambda: ChunkSource.from_tensor(kv))], ConnectorTarget(conn))
    assert outcome.error is None and torch.equal(conn.kv, kv)
    out = torch.empty(2, 1, 3, 4)
    conn.gather(out, 2, 5)
    assert torch.equal(out, kv[:, :, 2:5])


def test_kvtools_connectors_make_no_memory_object_inside(monkeypatch):
    """A load into paged or nested buffers, and a gather, never wrap a chunk in a MemoryObj to
    unwrap it again (before: every scattered chunk went through MemoryObj.from_tensor)."""
    from kvtool.chunk_source import ChunkSource
    from kvtool.connectors import memory
    from kvtool.load import ChunkTask, load

    made = []
    for maker in ("from_tensor", "allocate"):
        original = getattr(memory.MemoryObj, maker).__func__
        monkeypatch.setattr(memory.MemoryObj, maker,
                            classmethod(lambda cls, *a, _f=original, **k: made.append(cls) or _f(cls, *a, **k)))
    L, H, D, NB, BS, T = 2, 2, 4, 6, 4, 8
    kv = torch.randn(2, L, T, H * D)
    paged = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
    v2 = PagedMemConnectorV2(H * D, L, layout="flash_attn")
    nested = tuple((torch.zeros(T, H * D), torch.zeros(T, H * D)) for _ in range(L))
    for target in (v2.target(kvcaches=paged, slot_mapping=torch.arange(T)),
                   NestedTupleConnector(H * D, L).target(kvcaches=nested)):
        tasks = [ChunkTask(0, 4, lambda: ChunkSource.from_tensor(kv[:, :, :4])),  # raw: copied from its bytes
                 ChunkTask(4, 8, lambda: ChunkSource.from_tensor(kv), origin=0)]  # part of a chunk: decoded
        assert load(tasks, target).error is None
    out = torch.empty(2, L, T, H * D)
    v2.gather(out, 0, T, kvcaches=paged, slot_mapping=torch.arange(T))
    assert torch.equal(out, kv)
    assert made == []
