"""The GPU decode's launch table is laid out on the host (no GPU needed to check it): the
column-at-a-time `section_table` against its row-at-a-time reference `section_rows`, on the
headers of real CacheGen payloads of two geometries, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool.codecs import get_codec
from kvtool.codecs.cachegen import gpu
from kvtool.codecs.cachegen.bins import resolve_bins
from kvtool.codecs.cachegen.params import default_params, validate_params
from kvtool.codecs.cachegen.payload import DTYPE_CODE_OF, parse_header


def metas_of(shapes, dtype=torch.bfloat16):
    codec = get_codec("cachegen")
    metas, sizes = [], []
    for i, shape in enumerate(shapes):
        kv = (torch.randn(*shape, generator=torch.Generator().manual_seed(i)) * 2).to(dtype)
        payload, params = codec.encode(kv, default_params())
        p = validate_params(params)
        _, L, T, C = shape
        bins = resolve_bins(p["bins"], L)
        hdr = parse_header(payload, 2 * L, T, C, DTYPE_CODE_OF["bfloat16"], [b // 2 - 1 for b in bins])
        metas.append((tuple(shape), hdr))
        sizes.append(len(payload))
    starts = np.concatenate([[0], np.cumsum([(s + 3) & ~3 for s in sizes])]).astype(np.int64)
    return metas, starts


def test_section_table_equals_its_row_at_a_time_reference():
    shapes = [(2, 4, 32, 64), (2, 4, 32, 64), (2, 3, 16, 48), (2, 4, 7, 64)]
    metas, starts = metas_of(shapes)
    outs = [1 << 40, (1 << 40) + 10_000_000, (1 << 41) + 64, (1 << 42)]

    def scratch(T, C, M):  # any function of the three: the layout must follow it
        return 1000 + 7 * T + 3 * C + M

    got = gpu.section_table(metas, outs, 1 << 36, starts, 2, DTYPE_CODE_OF["bfloat16"], scratch)
    want = gpu.section_rows(metas, outs, 1 << 36, starts, 2, DTYPE_CODE_OF["bfloat16"], scratch)
    assert got[0].tobytes() == want[0].tobytes()
    assert np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert len(got[0]) == sum(2 * s[1] for s in shapes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_flags_agree_with_isfinite(device, dtype):
    """The GPU decode's check 13 (one reduction a chunk) against torch.isfinite, value by value:
    NaN, +inf and -inf anywhere, alone or together, in chunks that are and are not contiguous."""
    from kvtool.chunk_source import nonfinite_flags

    gen = torch.Generator().manual_seed(1)
    tensors = []
    for i, bad in enumerate([None, float("nan"), float("inf"), float("-inf"), "both", None]):
        t = (torch.randn(2, 3, 17, 40, generator=gen) * 100).to(dtype)
        if bad == "both":
            t[1, 2, 16, 39], t[0, 0, 0, 0] = float("inf"), float("nan")
        elif bad is not None:
            t[i % 2, 1, 3 * i, 7] = bad
        tensors.append(t.to(device))
    tensors.append(tensors[1][:, :, 1::2])  # a strided view that keeps its NaN (token 3)
    want = [bool((~torch.isfinite(t)).any()) for t in tensors]
    assert want == [False, True, True, True, True, False, True]
    assert nonfinite_flags(tensors) == want
    assert nonfinite_flags([]) == []
