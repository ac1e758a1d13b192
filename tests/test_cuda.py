"""CUDA backend: kernels compile for sm_90 (nvcc, no GPU needed), the shared
host/device headers are right (gcc shims on the CPU), and, on a GPU, the
kernels equal the CPU paths byte for byte.

GPU tests skip cleanly without CUDA; run them with `scripts/gpu_check.sh`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtool.connectors import PagedLayout, gather_paged, run_offset, scatter_paged, slot_to_block_offset
from kvtool.connectors.paged_copy import layer_tensors

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.isfile("/usr/local/cuda/bin/nvcc") else None)
GCC = shutil.which("gcc") or shutil.which("cc")
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (GPU tests: scripts/gpu_check.sh)")
LAYOUTS = [layout for layout in PagedLayout
           if layout not in (PagedLayout.VLLM_CPU, PagedLayout.VLLM_CPU_AMX)]  # the kernel's layouts (not the host pages)
LAYOUT_CODE = {PagedLayout.FLASH_ATTN: 0, PagedLayout.FLASHINFER: 1, PagedLayout.VLLM: 2, PagedLayout.KV_TUPLE: 3}


# ---------------------------------------------------------------------------
# nvcc: every .cu compiles for sm_90 (CI has nvcc but no GPU)
# ---------------------------------------------------------------------------


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_every_cu_compiles_for_sm90(tmp_path):
    cus = sorted(KERNELS.glob("*.cu"))
    assert cus, "no .cu files in kernels/"
    procs = []
    for cu in cus:
        cmd = [NVCC, "-arch=sm_90", "-std=c++17", "-O3", f"-I{KERNELS}", "-c", str(cu), "-o", str(tmp_path / (cu.stem + ".o"))]
        procs.append((cu, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    failures = []
    for cu, p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            failures.append(f"{cu.name}:\n{out}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------
# CPU: the shared index header, through a gcc-built shim
# ---------------------------------------------------------------------------


def _build_shim(tmp: Path, src: str, name: str) -> ctypes.CDLL:
    if GCC is None:
        pytest.skip("no C compiler")
    so = tmp / f"{name}.so"
    cmd = [GCC, "-O2", "-std=c99", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-shared", "-fPIC",
           f"-I{KERNELS}", str(KERNELS / src), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    lib = _build_shim(tmp_path_factory.mktemp("paged_shim"), "paged_index_test_shim.c", "paged_index_shim")
    i64, u32, u64, i32 = ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
    P = ctypes.POINTER
    lib.shim_run_offset.restype = i64
    lib.shim_run_offset.argtypes = [i32, i64, i64, i64, i64, P(i64), i64]
    lib.shim_slot_to_block_offset.restype = None
    lib.shim_slot_to_block_offset.argtypes = [i64, i64, P(i64), P(i64)]
    lib.shim_div_mismatches.restype = i64
    lib.shim_div_mismatches.argtypes = [u32, u32, u32]
    lib.shim_div.restype = u32
    lib.shim_div.argtypes = [u32, u32]
    lib.shim_pick_vec_bytes.restype = u32
    lib.shim_pick_vec_bytes.argtypes = [u64, i64, u32, i64]
    lib.shim_max_tokens_per_launch.restype = i64
    lib.shim_max_tokens_per_launch.argtypes = [i64, i64]
    lib.shim_map.restype = i64
    lib.shim_map.argtypes = [i32, P(i64), i64, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64]
    return lib


def _strides(st) -> ctypes.Array:
    return (ctypes.c_int64 * 5)(*st, *([0] * (5 - len(st))))


def test_header_run_offset_matches_connector(shim):
    rng = np.random.default_rng(1)
    for layout in LAYOUTS:
        ndim = 5 if layout in (PagedLayout.FLASH_ATTN, PagedLayout.FLASHINFER) else 4
        for _ in range(400):
            st = [int(x) for x in rng.integers(1, 1 << 20, size=ndim)]
            kv, block, off, head, D = (int(rng.integers(0, 2)), int(rng.integers(0, 1 << 16)),
                                       int(rng.integers(0, 1024)), int(rng.integers(0, 64)), int(rng.integers(1, 512)))
            want = run_offset(layout, kv, block, off, head, st, D)
            assert shim.shim_run_offset(LAYOUT_CODE[layout], kv, block, off, head, _strides(st), D) == want


def test_header_slot_to_block_offset(shim):
    b, o = ctypes.c_int64(), ctypes.c_int64()
    for slot in [0, 1, 15, 16, 17, 12345, (1 << 31) - 1, 1 << 31, (1 << 40) + 7]:
        for bs in [1, 2, 16, 17, 256, 1000]:
            shim.shim_slot_to_block_offset(slot, bs, ctypes.byref(b), ctypes.byref(o))
            assert (b.value, o.value) == slot_to_block_offset(slot, bs)


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 16, 17, 96, 127, 128, 192, 1000, 4095, 65537, 1 << 20, 999_999_937,
                               (1 << 30) + 1, (1 << 31) - 1, 1 << 31])
def test_header_magic_division_exact(shim, d):
    hi = 1 << 31
    assert shim.shim_div_mismatches(d, 0, 200_000) == 0
    assert shim.shim_div_mismatches(d, hi - 200_000, hi) == 0
    rng = np.random.default_rng(d)
    for n in rng.integers(0, hi, size=2000):
        assert shim.shim_div(d, int(n)) == int(n) // d
    for k in range(1, 6):  # around multiples of d
        for n in (k * d - 1, k * d, k * d + 1):
            if 0 <= n < hi:
                assert shim.shim_div(d, n) == n // d


def test_header_pick_vec_bytes(shim):
    f = shim.shim_pick_vec_bytes
    assert f(0, 128, 2, 1) == 16          # aligned bf16, D=128: 8 channels per access
    assert f(0, 64, 4, 1) == 16           # fp32
    assert f(0, 2, 2, 1) == 4             # D=2 bf16: the whole head
    assert f(8, 128, 2, 1) == 8           # an address only 8-aligned
    assert f(2, 128, 2, 1) == 2           # 2-aligned: one element
    assert f(0, 3, 2, 1) == 2             # D=3: one element
    assert f(0, 6, 2, 1) == 4             # D=6: pairs
    assert f(0, 128, 2, 7) == 2           # strided channels: one element
    assert f(0, 128, 8, 1) == 16          # 8-byte elements: pairs
    assert f(4, 128, 8, 1) == 8           # raw esize never split
    assert f(0, 128, 1, 1) == 16


# -- the whole per-item mapping, emulated, equals the torch reference -------------


def make_caches(layout: PagedLayout, L: int, NB: int, BS: int, H: int, D: int, dtype, variant: str,
                device="cpu", gen: torch.Generator | None = None):
    """Paged buffers of `layout`: 'contig', 'permuted' (heads-major memory order,
    non-contiguous), 'strided' (channels not contiguous), 'offset' (a view that
    starts inside its storage)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    def one():
        if layout is PagedLayout.FLASH_ATTN:
            if variant == "permuted":
                return rnd(2, NB, H, BS, D).permute(0, 1, 3, 2, 4)
            if variant == "strided":
                return rnd(2, NB, BS, D, H).transpose(3, 4)
            if variant == "offset":
                return rnd(2, NB + 3, BS, H, D)[:, 2:NB + 2]
            return rnd(2, NB, BS, H, D)
        if layout is PagedLayout.FLASHINFER:
            if variant == "permuted":
                return rnd(NB, 2, H, BS, D).permute(0, 1, 3, 2, 4)
            if variant == "strided":
                return rnd(NB, 2, BS, D, H).transpose(3, 4)
            if variant == "offset":
                return rnd(NB + 1, 2, BS, H, D)[1:]
            return rnd(NB, 2, BS, H, D)
        if layout is PagedLayout.VLLM:
            if variant == "permuted":
                return rnd(NB, BS, H, 2 * D).permute(0, 2, 1, 3)
            if variant == "strided":
                return rnd(NB, H, 2 * D, BS).transpose(2, 3)
            if variant == "offset":
                return rnd(NB + 2, H, BS, 2 * D)[2:]
            return rnd(NB, H, BS, 2 * D)
        def kv1():
            if variant == "permuted":
                return rnd(NB, H, BS, D).permute(0, 2, 1, 3)
            if variant == "strided":
                return rnd(NB, BS, D, H).transpose(2, 3)
            if variant == "offset":
                return rnd(NB + 1, BS, H, D)[1:]
            return rnd(NB, BS, H, D)
        return (kv1(), kv1())

    return [one() for _ in range(L)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,))


def _emulate(shim, layers, layout, slots: torch.Tensor, blob: torch.Tensor, E: int, direction: str, splits: int = 1):
    """Run the header's mapping for every item of the launch(es) and move the
    elements with numpy indexing, as the kernel would."""
    tensors = [t for layer in layers for t in layer_tensors(layer, layout)]
    st = tensors[0].stride()
    s_last = st[-1]
    _, L, T, HD = blob.shape
    first = tensors[0]
    if layout is PagedLayout.VLLM:
        NB, H, BS, D2 = first.shape
        D = D2 // 2
    elif layout is PagedLayout.KV_TUPLE:
        NB, BS, H, D = first.shape
    elif layout is PagedLayout.FLASH_ATTN:
        _, NB, BS, H, D = first.shape
    else:
        NB, _, BS, H, D = first.shape
    slots_np = np.ascontiguousarray(slots.numpy().astype(np.int64))
    bflat = blob.view(-1)
    bounds = np.linspace(0, T, splits + 1).astype(int)
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        if t1 <= t0:
            continue
        cap = 2 * L * (t1 - t0) * H * D // E
        ce, be, pi = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int32)
        n = shim.shim_map(LAYOUT_CODE[layout], _strides(st), L, H, D, BS, NB, E, T, int(t0), int(t1 - t0),
                          slots_np.ctypes.data, ce.ctypes.data, be.ctypes.data, pi.ctypes.data, cap)
        assert n == cap, n
        for idx, t in enumerate(tensors):
            m = pi == idx
            flat = _flat(t)
            for e in range(E):
                src_i = torch.from_numpy(ce[m] + e * s_last)
                dst_i = torch.from_numpy(be[m] + e)
                if direction == "gather":
                    bflat[dst_i] = flat[src_i].to(bflat.dtype)
                else:
                    flat[src_i] = bflat[dst_i].to(flat.dtype)


def _clone_layers(layers):
    return [_clone_strided(l) if isinstance(l, torch.Tensor) else tuple(_clone_strided(t) for t in l) for l in layers]


def _clone_strided(t: torch.Tensor) -> torch.Tensor:
    """A copy with exactly t's strides (and a storage of its own)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    store = torch.empty(span, dtype=t.dtype, device=t.device)
    c = store.as_strided(t.shape, t.stride())
    c.copy_(t)
    return c


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
    return torch.equal(a.contiguous().view(ints).cpu(), b.contiguous().view(ints).cpu())


def _layers_equal(xs, ys) -> bool:
    for x, y in zip(xs, ys):
        for a, b in zip((x,) if isinstance(x, torch.Tensor) else x, (y,) if isinstance(y, torch.Tensor) else y):
            if not _same_bits(a, b):
                return False
    return True


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("variant", ["contig", "permuted", "strided", "offset"])
def test_header_mapping_reproduces_gather_and_scatter(shim, layout, variant):
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout.value}{variant}".encode()) & 0xFFFF)
    L, NB, BS, H, D, T = 3, 9, 4, 3, 8, 13
    layers = make_caches(layout, L, NB, BS, H, D, torch.float32, variant, gen=g)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    want = torch.empty(2, L, T, H * D)
    gather_paged(layers, layout, slots, want)
    s_last = layer_tensors(layers[0], layout)[0].stride()[-1]
    for E in ([1, 2, 4, 8] if s_last == 1 else [1]):
        for splits in (1, 3):
            got = torch.full((2, L, T, H * D), float("nan"))
            _emulate(shim, layers, layout, slots, got, E, "gather", splits)
            assert _same_bits(got, want), (E, splits)
        # scatter: the emulated writes equal the reference's, and touch nothing else
        blob = torch.randn(2, L, T, H * D, generator=g)
        ref_layers, emu_layers = _clone_layers(layers), _clone_layers(layers)
        scatter_paged(blob, ref_layers, layout, slots)
        _emulate(shim, emu_layers, layout, slots, blob, E, "scatter", 2)
        assert _layers_equal(emu_layers, ref_layers), E


def test_header_mapping_covers_every_blob_element_once(shim):
    L, NB, BS, H, D, T = 2, 5, 3, 2, 4, 7
    for layout in LAYOUTS:
        layers = make_caches(layout, L, NB, BS, H, D, torch.float32, "contig")
        tensors = [t for layer in layers for t in layer_tensors(layer, layout)]
        slots = np.arange(T, dtype=np.int64) * 2
        for E in (1, 2, 4):
            cap = 2 * L * T * H * D // E
            ce, be, pi = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int32)
            n = shim.shim_map(LAYOUT_CODE[layout], _strides(tensors[0].stride()), L, H, D, BS, NB, E, T, 0, T,
                              slots.ctypes.data, ce.ctypes.data, be.ctypes.data, pi.ctypes.data, cap)
            assert n == cap
            covered = np.sort((be[:, None] + np.arange(E)[None, :]).reshape(-1))
            assert np.array_equal(covered, np.arange(2 * L * T * H * D))
            assert np.all(be[1:] > be[:-1])  # consecutive items: consecutive blob addresses


def test_header_launch_split_bound(shim):
    assert shim.shim_max_tokens_per_launch(32, 128) == ((1 << 31) - 2) // (2 * 32 * 128)
    assert 2 * 80 * 128 * shim.shim_max_tokens_per_launch(80, 128) < (1 << 31) - 1


def test_header_plan_rejects_bad_geometry(shim):
    slots = np.zeros(4, np.int64)
    buf = np.empty(1024, np.int64)
    bufi = np.empty(1024, np.int32)
    args = (slots.ctypes.data, buf.ctypes.data, buf.ctypes.data, bufi.ctypes.data, 1024)
    st = _strides([64, 8, 2, 1])
    assert shim.shim_map(9, st, 1, 1, 2, 4, 1, 1, 4, 0, 4, *args) == -1          # layout
    assert shim.shim_map(3, st, 1, 1, 2, 4, 1, 1, 4, 2, 4, *args) == -2          # tokens past the blob
    assert shim.shim_map(3, st, 1, 1, 6, 4, 1, 4, 4, 0, 4, *args) == -3          # E does not divide D
    assert shim.shim_map(3, st, 1 << 20, 64, 128, 4, 1, 1, 4, 0, 4, *args) == -2  # >= 2^31 items


# ---------------------------------------------------------------------------
# Loader / status on a machine without CUDA
# ---------------------------------------------------------------------------


def test_backend_status_is_one_line():
    from kvtool import cuda_build as kc

    s = kc.backend_status()
    assert isinstance(s, str) and s and "\n" not in s
    if not HAS_CUDA:
        assert "CPU" in s


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA path")
def test_no_cuda_never_looks_for_nvcc(monkeypatch):
    from kvtool import cuda_build as _build
    from kvtool.connectors.paged_copy import load_cuda_kernel
    from kvtool.errors import CudaUnavailable

    def boom(*a, **k):
        raise AssertionError("nvcc must not be looked for without CUDA")

    monkeypatch.setattr(_build, "find_nvcc", boom)
    monkeypatch.setattr(_build.subprocess, "run", boom)
    _build.reset_for_tests()
    assert load_cuda_kernel() is None  # one notice, then the torch path
    assert "CPU" in _build.backend_status(build=True)
    with pytest.raises(CudaUnavailable):
        _build.load("paged_copy")
    _build.reset_for_tests()


def test_disabled_by_env(monkeypatch):
    from kvtool import cuda_build as _build
    from kvtool.errors import CudaUnavailable

    monkeypatch.setenv("KVTOOL_CUDA", "0")
    _build.reset_for_tests()
    assert "disabled" in _build.backend_status()
    with pytest.raises(CudaUnavailable, match="KVTOOL_CUDA=0"):
        _build.load("paged_copy")
    _build.reset_for_tests()


def test_kernel_sources_are_found():
    from kvtool import cuda_build as _build

    assert _build.kernels_dir() == KERNELS


# ---------------------------------------------------------------------------
# GPU: the fused kernel equals the CPU connector, byte for byte
# ---------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _to(layers, device):
    return [l.to(device) if isinstance(l, torch.Tensor) else tuple(t.to(device) for t in l) for l in layers]


def _to_strided(layers, device):
    """Move to `device` keeping each tensor's strides (and storage offset pattern)."""
    out = []
    for layer in layers:
        ts = (layer,) if isinstance(layer, torch.Tensor) else layer
        moved = []
        for t in ts:
            span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            store = torch.empty(span + 64, dtype=t.dtype, device=device)
            off = 0 if t.storage_offset() == 0 else 3  # "offset" variants: not 16-byte aligned
            c = store.as_strided(t.shape, t.stride(), off)
            c.copy_(t)
            moved.append(c)
        out.append(moved[0] if isinstance(layer, torch.Tensor) else tuple(moved))
    return out


def _random_slots(NB, BS, T, gen, distinct=True):
    if distinct:
        return torch.randperm(NB * BS, generator=gen)[:T]
    return torch.randint(0, NB * BS, (T,), generator=gen)


def _gpu_copies_equal_cpu(cpu, gpu, layout, slots, hidden, blob_dtype, gen, scale=1.0, vec_bytes=None) -> None:
    """The fused kernel's gather and scatter on `gpu` (a CUDA copy of the buffers `cpu`) give the
    CPU connector's bits: gather into a NaN-filled blob, then scatter a random blob back."""
    from kvtool.connectors import paged_cuda as paged

    shape = (2, len(cpu), slots.shape[0], hidden)
    want = torch.empty(shape, dtype=blob_dtype)
    gather_paged(cpu, layout, slots, want)
    got = torch.full(shape, float("nan"), dtype=blob_dtype, device="cuda")
    assert paged.gather(gpu, layout, slots.cuda(), got)
    torch.cuda.synchronize()
    assert _same_bits(got, want)
    if vec_bytes is not None:
        assert paged.last_vec_bytes() == vec_bytes
    blob = (torch.randn(shape, generator=gen) * scale).to(blob_dtype)
    scatter_paged(blob, cpu, layout, slots)
    assert paged.scatter(blob.cuda(), gpu, layout, slots.cuda())
    torch.cuda.synchronize()
    assert _layers_equal(_to(gpu, "cpu"), cpu)


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 7, 256, 8000])
def test_gpu_gather_scatter_equal_cpu(layout, dtype, T):
    g = torch.Generator().manual_seed(T * 7 + LAYOUT_CODE[layout])
    L, BS, H, D = 4, 16, 4, 128
    NB = (T + BS - 1) // BS + 37
    cpu = make_caches(layout, L, NB, BS, H, D, dtype, "contig", gen=g)
    _gpu_copies_equal_cpu(cpu, _to(cpu, "cuda"), layout, _random_slots(NB, BS, T, g), H * D, dtype, g,
                          vec_bytes=16)


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("variant", ["permuted", "strided", "offset"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_noncontiguous_buffers(layout, variant, dtype):
    g = torch.Generator().manual_seed(11)
    L, NB, BS, H, D, T = 3, 40, 16, 2, 64, 300
    cpu = make_caches(layout, L, NB, BS, H, D, dtype, variant, gen=g)
    _gpu_copies_equal_cpu(cpu, _to_strided(cpu, "cuda"), layout, _random_slots(NB, BS, T, g), H * D, dtype, g)


@needs_gpu
@pytest.mark.parametrize("cdt,bdt", [(a, b) for a in GPU_DTYPES for b in GPU_DTYPES if a != b], ids=str)
@pytest.mark.parametrize("layout", [PagedLayout.FLASH_ATTN, PagedLayout.VLLM, PagedLayout.KV_TUPLE], ids=lambda l: l.value)
def test_gpu_dtype_conversion_equals_cpu(cdt, bdt, layout):
    g = torch.Generator().manual_seed(5)
    L, NB, BS, H, D, T = 2, 20, 8, 2, 32, 100
    cpu = make_caches(layout, L, NB, BS, H, D, cdt, "contig", gen=g)
    _gpu_copies_equal_cpu(cpu, _to(cpu, "cuda"), layout, _random_slots(NB, BS, T, g), H * D, bdt, g, scale=3.0)


@needs_gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_gpu_pinned_host_blob(layout):
    """The blob in pinned host memory: the kernel reads/writes it over the bus."""
    from kvtool.connectors import paged_cuda as paged

    g = torch.Generator().manual_seed(3)
    L, NB, BS, H, D, T = 3, 30, 16, 4, 64, 333
    cpu = make_caches(layout, L, NB, BS, H, D, torch.bfloat16, "contig", gen=g)
    gpu = _to(cpu, "cuda")
    slots = _random_slots(NB, BS, T, g)
    want = torch.empty(2, L, T, H * D, dtype=torch.bfloat16)
    gather_paged(cpu, layout, slots, want)
    host = torch.empty(2, L, T, H * D, dtype=torch.bfloat16, pin_memory=True)
    assert paged.gather(gpu, layout, slots.cuda(), host)
    torch.cuda.synchronize()
    assert _same_bits(host, want)
    blob = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16).pin_memory()
    scatter_paged(blob, cpu, layout, slots)
    assert paged.scatter(blob, gpu, layout, slots.cuda())
    torch.cuda.synchronize()
    assert _layers_equal(_to(gpu, "cpu"), cpu)
    with pytest.raises(Exception, match="pinned"):
        paged.gather(gpu, layout, slots.cuda(), torch.empty(2, L, T, H * D, dtype=torch.bfloat16))


@needs_gpu
def test_gpu_odd_geometry_and_raw_dtypes():
    """D not a multiple of 8 (narrow accesses), fp64 (raw 8-byte elements), 1 layer, block size 1."""
    from kvtool.connectors import paged_cuda as paged

    g = torch.Generator().manual_seed(9)
    for (L, NB, BS, H, D, T, dt) in [(1, 50, 1, 3, 6, 40, torch.bfloat16), (2, 17, 5, 1, 3, 60, torch.float16),
                                     (2, 9, 16, 2, 16, 100, torch.float64), (5, 300, 32, 8, 128, 8000, torch.float32)]:
        for layout in LAYOUTS:
            cpu = make_caches(layout, L, NB, BS, H, D, dt, "contig", gen=g)
            gpu = _to(cpu, "cuda")
            slots = _random_slots(NB, BS, T, g)
            want = torch.empty(2, L, T, H * D, dtype=dt)
            gather_paged(cpu, layout, slots, want)
            got = torch.empty(2, L, T, H * D, dtype=dt, device="cuda")
            assert paged.gather(gpu, layout, slots.cuda(), got)
            assert _same_bits(got, want), (L, NB, BS, H, D, T, dt, layout)


@needs_gpu
def test_gpu_repeated_slots_gather():
    from kvtool.connectors import paged_cuda as paged

    g = torch.Generator().manual_seed(2)
    L, NB, BS, H, D, T = 2, 4, 16, 2, 64, 500
    for layout in LAYOUTS:
        cpu = make_caches(layout, L, NB, BS, H, D, torch.bfloat16, "contig", gen=g)
        slots = _random_slots(NB, BS, T, g, distinct=False)
        want = torch.empty(2, L, T, H * D, dtype=torch.bfloat16)
        gather_paged(cpu, layout, slots, want)
        got = torch.empty_like(want, device="cuda")
        assert paged.gather(_to(cpu, "cuda"), layout, slots.cuda(), got)
        assert _same_bits(got, want)


@needs_gpu
def test_gpu_registered_connector_round_trip():
    """The connector's CUDA path runs the fused kernel; from_gpu/to_gpu round trip."""
    from kvtool.connectors import MemoryFormat, PagedMemConnectorV2
    from kvtool.connectors.paged_copy import load_cuda_kernel

    assert load_cuda_kernel() is not None
    g = torch.Generator().manual_seed(4)
    L, NB, BS, H, D, T = 4, 64, 16, 2, 64, 700
    for layout in LAYOUTS:
        cpu = make_caches(layout, L, NB, BS, H, D, torch.bfloat16, "contig", gen=g)
        gpu = _to(cpu, "cuda")
        full = torch.full((T + 10,), -1, dtype=torch.int64)
        full[10:] = _random_slots(NB, BS, T, g)
        conn = PagedMemConnectorV2(H * D, L, use_gpu=True, layout=layout, chunk_size=256)
        for dev in ("cuda", "cpu"):
            mo = conn.allocate(T, torch.bfloat16, dev, pin_memory=(dev == "cpu"))
            conn.from_gpu(mo, 10, T + 10, kvcaches=gpu, slot_mapping=full.cuda())
            ref = torch.empty(2, L, T, H * D, dtype=torch.bfloat16)
            gather_paged(cpu, layout, full[10:], ref)
            torch.cuda.synchronize()
            assert mo.metadata.fmt == MemoryFormat.KV_BLOB
            assert _same_bits(mo.tensor, ref)
            zero = _to([tuple(torch.zeros_like(t) for t in l) if isinstance(l, tuple) else torch.zeros_like(l)
                        for l in cpu], "cuda")
            conn.to_gpu(mo, 10, T + 10, kvcaches=zero, slot_mapping=full.cuda())
            back = torch.empty_like(ref)
            gather_paged(_to(zero, "cpu"), layout, full[10:], back)
            assert _same_bits(back, ref)


# ---------------------------------------------------------------------------
# CacheGen: host/device helpers of cachegen_cuda.h on the CPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cg_shim(tmp_path_factory):
    lib = _build_shim(tmp_path_factory.mktemp("cg_shim"), "cachegen_cuda_test_shim.c", "cachegen_cuda_shim")
    u32, u64, i32, i64 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64
    P = ctypes.POINTER
    lib.shim_rice_code.restype = u64
    lib.shim_rice_code.argtypes = [u32, u32, i32, i32, P(u32)]
    lib.shim_rice_cost.restype = u64
    lib.shim_rice_cost.argtypes = [u32, u32, i32, i32]
    lib.shim_place_bits.restype = None
    lib.shim_place_bits.argtypes = [u64, u64, P(u32)]
    lib.shim_section_len.restype = u64
    lib.shim_section_len.argtypes = [u64, u32, u32]
    lib.shim_side_cap_words.restype = u64
    lib.shim_side_cap_words.argtypes = [u32, u32]
    lib.shim_encode_layout.restype = None
    lib.shim_encode_layout.argtypes = [u32, u32, i32, P(u64)]
    lib.shim_decode_layout.restype = None
    lib.shim_decode_layout.argtypes = [u32, u32, i32, i32, P(u64)]
    lib.shim_dec_table_size.restype = u32
    lib.shim_dec_table_size.argtypes = [i32]
    lib.shim_dec_table_index.restype = u64
    lib.shim_dec_table_index.argtypes = [u32, u32, u32]
    lib.shim_dec_table_bytes.restype = u64
    lib.shim_dec_table_bytes.argtypes = [u32, i32]
    lib.shim_resynth_side.restype = i64
    lib.shim_resynth_side.argtypes = [ctypes.c_char_p, u64, i32, u32, u32, ctypes.c_void_p, u64]
    lib.shim_gtab_mismatches.restype = i64
    lib.shim_gtab_mismatches.argtypes = [i32, i32, u32, ctypes.c_void_p, u32]
    return lib


@pytest.mark.parametrize("bins,prob_bits,stride", [(4, 10, 1), (16, 14, 1), (32, 14, 3), (64, 15, 7), (256, 14, 61),
                                                   (34, 12, 1), (200, 15, 97)])
def test_cachegen_gaussian_table_search_equals_per_channel_tables(cg_shim, bins, prob_bits, stride):
    """CGC_VAR_GTAB's decoder reads one shared table of Gaussian offsets instead of per-channel
    cumulative frequencies: for every sigma and mean code it must find the same symbol and the same
    cum[sym], cum[sym + 1] as cg_build_cum's table, at every (stride-th) slot."""
    M = bins // 2 - 1
    gtab = np.zeros(32 * (8 * (2 * M + 1) - 11), dtype=np.uint16)
    bad = cg_shim.shim_gtab_mismatches(M, prob_bits, stride, gtab.ctypes.data, gtab.size)
    assert bad == 0


def _rice_bits_py(v: int, base: int, k: int, w: int) -> tuple[int, int]:
    """format-spec/cachegen.md section 4, as an LSB-first integer and its length."""
    z = 2 * (v - base) if v >= base else 2 * (base - v) - 1
    q = z >> k
    if q < 16:
        return ((1 << q) - 1) | ((z & ((1 << k) - 1)) << (q + 1)), q + 1 + k
    return 0xFFFF | (v << 16), 16 + w


def test_cachegen_helpers_rice_code(cg_shim):
    rng = np.random.default_rng(7)
    n = ctypes.c_uint32()
    for w in (5, 10, 16, 32):
        for _ in range(3000):
            v, base = (int(x) for x in rng.integers(0, 1 << w, size=2, dtype=np.uint64))
            if rng.random() < 0.5:  # near the base, the common case
                v = int(np.clip(base + int(rng.integers(-40, 41)), 0, (1 << w) - 1))
            k = int(rng.integers(0, min(w, 31) + 1))
            code = cg_shim.shim_rice_code(v, base, k, w, ctypes.byref(n))
            assert (code, n.value) == _rice_bits_py(v, base, k, w)
            assert n.value == cg_shim.shim_rice_cost(v, base, k, w)


def test_cachegen_helpers_place_bits(cg_shim):
    rng = np.random.default_rng(8)
    w3 = (ctypes.c_uint32 * 3)()
    for _ in range(5000):
        ln = int(rng.integers(1, 49))
        code = int(rng.integers(0, 1 << ln, dtype=np.uint64))
        pos = int(rng.integers(0, 1 << 40))
        cg_shim.shim_place_bits(code, pos, w3)
        want = code << (pos & 31)
        assert [w3[0], w3[1], w3[2]] == [want & 0xFFFFFFFF, (want >> 32) & 0xFFFFFFFF, want >> 64]


def test_cachegen_helpers_layouts(cg_shim):
    o = (ctypes.c_uint64 * 9)()
    for T, C, M in [(1, 1, 1), (256, 192, 15), (255, 1023, 7), (8000, 1024, 127), (3, 5, 1)]:
        cg_shim.shim_encode_layout(T, C, M, o)
        offs = list(o)
        sizes = [T * C, 4 * T, 4 * C, 4 * C, 2 * C * (2 * M + 2), 4 * cg_shim.shim_side_cap_words(T, C),
                 2 * (T * C + 1), 256]
        assert all(x % 16 == 0 for x in offs)
        for i, s in enumerate(sizes):
            assert offs[i] + s <= offs[i + 1], (T, C, M, i)
        S = cg_shim.shim_dec_table_size(M)
        assert S >= 2 * M + 2 and S & (S - 1) == 0 and S // 2 < 2 * M + 2
        for wt in (0, 1):
            d = (ctypes.c_uint64 * 5)()
            cg_shim.shim_decode_layout(T, C, M, wt, d)
            assert d[1] >= 4 * T and d[2] >= d[1] + 4 * C and d[3] >= d[2] + 4 * C
            assert d[4] >= d[3] + wt * cg_shim.shim_dec_table_bytes(C, M)
    # decoder tables: a bijection into the table, 32 consecutive channels x one entry = 64 contiguous bytes
    for C, M in [(1, 1), (40, 15), (64, 7), (100, 127)]:
        S = cg_shim.shim_dec_table_size(M)
        idx = {cg_shim.shim_dec_table_index(c, e, S) for c in range(C) for e in range(S)}
        assert len(idx) == C * S and max(idx) < cg_shim.shim_dec_table_bytes(C, M) // 2
        for e in (0, S - 1):
            col = [cg_shim.shim_dec_table_index(c, e, S) for c in range(32 * (C > 32), min(C, 64))]
            assert col == list(range(col[0], col[0] + len(col)))
    # section length: side info to 32 bits, lane states, words, padding to 4 bytes
    assert cg_shim.shim_section_len(1, 1, 0) == 8
    assert cg_shim.shim_section_len(32, 3, 1) == 4 + 12 + 4
    assert cg_shim.shim_section_len(33, 32, 7) == 8 + 128 + 16


def _cg_params(bins="default", prob_bits=14, lanes=32):
    return {"version": 1, "bins": bins, "prob_bits": prob_bits, "lanes": lanes}


def _cg_chunk(L, T, C, dtype, seed, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, T, C, generator=g)
    if kind == "outliers":
        x = x * torch.exp(torch.randn(2, L, 1, C, generator=g) * 2)
        x[:, :, ::7, 3 % C] *= 100
    elif kind == "zeros":
        x[:, :, ::3] = 0
    elif kind == "tiny" and dtype == torch.float32:
        x[:, :, 1::2] *= 1e-35  # scales below 2^-100: pre-scaled quantization
    elif kind == "constant":
        x = torch.full((2, L, T, C), 0.5)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape,params", [
    ((2, 16, 64), _cg_params()),
    ((3, 7, 33), _cg_params("k:*=256;v:*=4", 10, 7)),
    ((1, 1, 1), _cg_params("32", 15, 64)),
])
def test_cachegen_helpers_resynthesize_cpu_side_info(cg_shim, dtype, shape, params):
    from kvtool.codecs.cachegen import cachegen_encode
    from kvtool.codecs.cachegen import reference as ref

    L, T, C = shape
    kv = _cg_chunk(L, T, C, dtype, 3, "outliers")
    payload, p = cachegen_encode(kv, params)
    hdr = ref.parse_header(payload, 2 * L, T, C, None, None)
    cap = int(cg_shim.shim_side_cap_words(T, C)) + 8
    words = np.zeros(cap, np.uint32)
    for off, ln in zip(hdr.offsets, hdr.lengths):
        sec = bytes(payload[off:off + ln])
        bits = cg_shim.shim_resynth_side(sec, ln, ref.DTYPE_CODES[dtype], T, C, words.ctypes.data, cap)
        assert bits > 0
        nb = ((bits + 31) // 32) * 4
        assert words.view(np.uint8)[:nb].tobytes() == sec[:nb]


# ---------------------------------------------------------------------------
# CacheGen on the GPU: bytes equal the CPU coder's; decode is exact both ways
# ---------------------------------------------------------------------------

CG_CASES = [
    ((2, 16, 64), _cg_params(), "normal"),
    ((3, 7, 33), _cg_params("k:*=256;v:*=4", 10, 7), "outliers"),
    ((1, 1, 1), _cg_params("32", 15, 64), "normal"),
    ((2, 5, 100), _cg_params("16", 12, 64), "zeros"),            # N = 64: two warp steps per group
    ((2, 9, 70), _cg_params("k:*=64;v:*=8", 14, 33), "outliers"),  # N = 33, a partial last group
    ((1, 300, 3), _cg_params("default", 14, 32), "normal"),       # C < lanes: N = 3
    ((2, 4, 40), _cg_params("default", 11, 1), "tiny"),           # one lane
    ((2, 8, 16), _cg_params(), "constant"),
    ((4, 256, 192), _cg_params(), "outliers"),                    # the default model's geometry
]


def _cpu_encode(kv, params):
    from kvtool.codecs.cachegen import cachegen_encode

    return cachegen_encode(kv.cpu(), params)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape,params,kind", CG_CASES)
def test_gpu_cachegen_bytes_and_decode_equal_cpu(dtype, shape, params, kind):
    from kvtool.codecs.cachegen import cachegen_decode
    from kvtool.codecs.cachegen import gpu as gcg

    L, T, C = shape
    kv = _cg_chunk(L, T, C, dtype, hash(shape) & 0xFFFF, kind)
    cpu_payload, cpu_p = _cpu_encode(kv, params)
    gpu_payload, gpu_p = gcg.encode(kv.cuda(), params)
    assert gpu_p == cpu_p
    assert gpu_payload == cpu_payload
    want = cachegen_decode(cpu_payload, kv.shape, dtype, cpu_p)
    modes = ["auto", "global"] + (["smem"] if gcg.library().cgc_decode_tables_in_smem(C, 127) else [])
    for tables in modes:
        for variant in gcg.DECODE_VARIANTS:
            got = gcg.decode(cpu_payload, kv.shape, dtype, cpu_p, tables=tables, variant=variant)
            assert _same_bits(got, want), (tables, variant)


@needs_gpu
def test_gpu_cachegen_realistic_chunk_and_batch():
    """A Llama-8B-like chunk (32 layers, 8x128 channels) and a batch of chunks
    of different lengths in one launch."""
    from kvtool.codecs.cachegen import cachegen_decode
    from kvtool.codecs.cachegen import gpu as gcg

    params = _cg_params()
    kvs = [_cg_chunk(32, T, 1024, torch.bfloat16, T, "outliers") for T in (256, 256, 100, 1)]
    cpu = [_cpu_encode(kv, params) for kv in kvs]
    gpu, p = gcg.encode_chunks([kv.cuda() for kv in kvs], params)
    assert p == cpu[0][1]
    assert [g == c[0] for g, c in zip(gpu, cpu)] == [True] * len(kvs)
    outs = gcg.decode_chunks([c[0] for c in cpu], [kv.shape for kv in kvs], torch.bfloat16, p)
    for o, (pl, pp), kv in zip(outs, cpu, kvs):
        assert _same_bits(o, cachegen_decode(pl, kv.shape, torch.bfloat16, pp))
    if gcg.library().cgc_decode_tables_in_smem(1024, 15):
        o2 = gcg.decode(cpu[0][0], kvs[0].shape, torch.bfloat16, p, tables="smem")
        assert _same_bits(o2, outs[0])


@needs_gpu
def test_gpu_cachegen_calibrated_variant_gives_the_same_values(monkeypatch):
    """A decode that names no variant times the candidates on its first batch of a geometry,
    keeps the fastest for that geometry, and decodes the CPU coder's values either way."""
    from kvtool.codecs.cachegen import cachegen_decode
    from kvtool.codecs.cachegen import gpu as gcg

    monkeypatch.delenv("KVTOOL_CACHEGEN_GPU_VARIANT", raising=False)
    monkeypatch.setattr(gcg, "_chosen", {})
    params = _cg_params()
    kvs = [_cg_chunk(4, 64, 192, torch.bfloat16, seed, "outliers") for seed in (1, 2, 3)]
    cpu = [_cpu_encode(kv, params) for kv in kvs]
    outs = gcg.decode_chunks([c[0] for c in cpu], [kv.shape for kv in kvs], torch.bfloat16, cpu[0][1])
    assert len(gcg._chosen) == 1 and next(iter(gcg._chosen.values())) in gcg.CALIBRATION_CANDIDATES
    (key, chosen), = gcg._chosen.items()
    assert gcg._saved_choices()[gcg._choice_name(key)] == chosen  # kept for the next process
    monkeypatch.setattr(gcg, "_chosen", {})
    monkeypatch.setattr(gcg, "CALIBRATION_CANDIDATES", ())  # a calibration now would choose the default
    assert gcg.chosen_variant([c[0] for c in cpu], [kv.shape for kv in kvs], torch.bfloat16, cpu[0][1]) == chosen
    for o, (pl, pp), kv in zip(outs, cpu, kvs):
        assert _same_bits(o, cachegen_decode(pl, kv.shape, torch.bfloat16, pp))
    monkeypatch.setenv("KVTOOL_CACHEGEN_GPU_VARIANT", "4")
    assert gcg.chosen_variant([c[0] for c in cpu], [kv.shape for kv in kvs], torch.bfloat16, cpu[0][1]) == 4
    monkeypatch.setenv("KVTOOL_CACHEGEN_GPU_VARIANT", "5")
    with pytest.raises(Exception, match="KVTOOL_CACHEGEN_GPU_VARIANT"):
        gcg.chosen_variant([c[0] for c in cpu], [kv.shape for kv in kvs], torch.bfloat16, cpu[0][1])


@needs_gpu
def test_gpu_cachegen_cpu_decodes_gpu_payload():
    from kvtool.codecs.cachegen import cachegen_decode, cachegen_reference_roundtrip
    from kvtool.codecs.cachegen import gpu as gcg

    for dtype in GPU_DTYPES:
        kv = _cg_chunk(3, 50, 96, dtype, 1, "outliers")
        payload, p = gcg.encode(kv.cuda(), None)
        out = cachegen_decode(payload, kv.shape, dtype, p)
        assert _same_bits(out, cachegen_reference_roundtrip(kv, p))
        assert _same_bits(gcg.decode(payload, kv.shape, dtype, p).cpu(), out)


@needs_gpu
def test_gpu_cachegen_nonfinite_and_errors():
    from kvtool.codecs.cachegen import gpu as gcg
    from kvtool.errors import NonFiniteValues, UsageError

    kv = _cg_chunk(2, 8, 16, torch.bfloat16, 2)
    kv[1, 1, 3, 5] = float("nan")
    with pytest.raises(NonFiniteValues):
        gcg.encode(kv.cuda(), None)
    kv[1, 1, 3, 5] = float("inf")
    with pytest.raises(NonFiniteValues):
        gcg.encode(kv.cuda(), None)
    with pytest.raises(UsageError):
        gcg.encode(kv, None)  # a CPU tensor


@needs_gpu
def test_gpu_cachegen_corrupt_payloads_like_cpu():
    """Every byte flip: the GPU decoder rejects what the CPU decoder rejects and
    decodes the rest to the same values."""
    from kvtool.codecs.cachegen import cachegen_decode
    from kvtool.codecs.cachegen import gpu as gcg
    from kvtool.errors import DecodeError

    rng = np.random.default_rng(0)
    for dtype, shape, params in [(torch.bfloat16, (2, 6, 40), _cg_params(lanes=7)),
                                 (torch.float32, (1, 5, 70), _cg_params("16", 12, 64))]:
        kv = _cg_chunk(*shape, dtype, 5, "outliers")
        payload, p = _cpu_encode(kv, params)
        positions = sorted(set(rng.integers(0, len(payload), size=150).tolist()) | set(range(0, 64)))
        for pos in positions:
            bad = bytearray(payload)
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            try:
                want = cachegen_decode(bytes(bad), kv.shape, dtype, p)
            except DecodeError:
                for variant in gcg.DECODE_VARIANTS:
                    with pytest.raises(DecodeError):
                        gcg.decode(bytes(bad), kv.shape, dtype, p, variant=variant)
                continue
            for variant in gcg.DECODE_VARIANTS:
                got = gcg.decode(bytes(bad), kv.shape, dtype, p, variant=variant)
                assert _same_bits(got, want), (pos, variant)
        for cut in (len(payload) - 4, len(payload) // 2, 30):
            with pytest.raises(DecodeError):
                gcg.decode(payload[:cut], kv.shape, dtype, p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_writer_encodes_cuda_chunks_on_the_gpu_to_the_cpu_bytes(tmp_path):
    """A capture on a GPU hands CUDA KV_BLOBs to the writer: the cachegen file is byte-identical."""
    from kvtool.format import ContainerWriter, ModelIdentity

    ident = ModelIdentity(name="t", architecture="LlamaForCausalLM", num_layers=4, num_attention_heads=8,
                          num_kv_heads=2, head_dim=64, hidden_size=256, intermediate_size=512,
                          vocab_size=100, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          rope={"rope_theta": 10000.0, "rope_scaling": None})
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(2, 4, 300, 128, generator=g) * 2).to(torch.bfloat16)
    paths = []
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.kvc"
        meta = {"created_at": "fixed"}
        with ContainerWriter(path, ident, list(range(300)), chunk_size=128, metadata=meta) as w:
            for s, e in w.chunk_ranges():
                w.write_chunk(kv[:, :, s:e].to(device), "cachegen")
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_kernels_turned_off_by_the_user_fall_back_without_a_notice(monkeypatch, capsys):
    from kvtool import notices
    from kvtool.connectors.paged_copy import load_cuda_kernel

    monkeypatch.setenv("KVTOOL_CUDA", "0")
    notices.forget()
    assert load_cuda_kernel() is None
    assert capsys.readouterr().err == ""  # the user asked for it: nothing to tell
