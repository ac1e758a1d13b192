"""The native CPU paged gather/scatter (kernels/paged_copy_cpu.c, connectors/paged_native.py)
against the torch reference (connectors/paged_torch.py): the same bytes on every layout, dtype
and stride pattern; out-of-range rows refused before anything is written."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from kvtool.connectors import paged_native, paged_torch
from kvtool.connectors.paged_layout import PagedLayout
from test_connectors import LAYOUTS, _strided_cases, clone_buffers, buffers_equal, make_buffers, shuffled_slots

native = paged_native.native_module()
needs_native = pytest.mark.skipif(native is None, reason="kvtool._paged_native is not built (no C compiler)")


def test_ci_builds_the_extension():  # not skipped: without the extension CI must fail here
    assert native is not None or os.environ.get("CI") != "true"


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,blob_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_same_bytes_as_the_torch_reference(layout, dtype, blob_dtype):
    gen = torch.Generator().manual_seed(1)
    T, BS, L, H, D = 133, 16, 3, 2, 8
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
        blob = torch.randn(2, L, T, H * D, generator=gen)
        ref, out = clone_buffers(bufs, layout), clone_buffers(bufs, layout)
        paged_torch.torch_scatter(blob, ref, PagedLayout(layout), slots)
        assert paged_native.native_scatter(blob, out, PagedLayout(layout), slots), name
        assert buffers_equal(ref, out, layout), name
        want, got = torch.empty_like(blob), torch.empty_like(blob)
        paged_torch.torch_gather(bufs, PagedLayout(layout), slots, want)
        assert paged_native.native_gather(bufs, PagedLayout(layout), slots, got), name
        assert torch.equal(want, got), name


@needs_native
def test_rows_out_of_range_are_refused_before_any_write():
    paged, blob = torch.zeros(4, 8), torch.ones(3, 8)
    pairs = struct.pack("<4Q", paged.data_ptr(), 4, blob.data_ptr(), 3)
    for rows in ([0, 1, 4], [0, -1, 2]):
        index = torch.tensor(rows, dtype=torch.int64)
        with pytest.raises(IndexError, match="out of range"):
            native.copy_rows(pairs, memoryview(index.numpy()).cast("B"), 32, 1, 2)
        assert not paged.any()
    short = struct.pack("<4Q", paged.data_ptr(), 4, blob.data_ptr(), 2)  # a blob of 2 rows for 3 indices
    with pytest.raises(IndexError):
        native.copy_rows(short, memoryview(torch.tensor([0, 1, 2]).numpy()).cast("B"), 32, 1, 1)
    assert not paged.any()
