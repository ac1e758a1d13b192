"""CacheGen on the GPU (kernels/cachegen_cuda.cu): encode/decode with the same
bytes and values as the CPU coder (format-spec/cachegen.md).

The payload header and section directory are written and validated on the
host by `payload.build_header` / `payload.parse_header`, as for the CPU coder;
the device produces and consumes the layer sections. Batched forms (`encode_chunks`, `decode_chunks`)
put every layer of every chunk into one launch: a warp per layer section, so
a batch of chunks is what fills a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np
import torch

from ... import cuda_build, pinned
from ...dtypes import itemsize
from ...errors import CodecParamsInvalid, DecodeError, NonFiniteValues, UsageError
from .bins import canonical_bins_spec, resolve_bins
from .params import check_chunk, check_shape, default_params, validate_params
from .payload import DTYPE_CODE_OF, build_header, check_table_budget, parse_header

SECTION_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("scratch", "<u8"), ("src_len", "<u8"), ("T", "<u4"),
                          ("C", "<u4"), ("M", "<i4"), ("P", "<i4"), ("N", "<i4"), ("dtype", "<i4"), ("r0", "<u4"),
                          ("r1", "<u4")])
RESULT_DTYPE = np.dtype([("side_bits", "<u8"), ("nwords", "<u4"), ("err", "<i4"), ("out_offset", "<u8"),
                         ("out_len", "<u8")])
assert SECTION_DTYPE.itemsize == 64 and RESULT_DTYPE.itemsize == 32
MAX_SECTIONS = 65535  # per encode launch (grid.y)
# decoder variant (cachegen_cuda.h, CGC_VAR_*): 1 = transposed tables, 2 = word window, 4 = one shared
# Gaussian table per warp in shared memory instead of per-channel tables; same output, different speed.
# H100, 32 chunks [2, 32, 256, 1024] bf16, tables in global memory: rows 75.6 GB/s, rows+window 75.2,
# transposed 54.8, transposed+window 55.1 (tables in shared memory: ~39-40 for all four: 3 warps per SM).
# Later, on an H100 (the load issue): the fastest variant depends on the geometry. Synthetic
# [2, 32, 256, 1024] chunks (1.66 bits/value): gtab 100.7 GB/s vs rows 74.6; real SmolLM2 KV
# [2, 30, 256, 192] (2.48 bits/value): rows 177 vs gtab 120. No fixed rule is measured on enough
# geometries, so a decode that names no variant calibrates: the first batch of a geometry is
# decoded with each candidate, timed, and the fastest kept for that geometry (`chosen_variant`).
VAR_TRANSPOSED, VAR_WINDOW, VAR_GTAB = 1, 2, 4
DECODE_VARIANTS = {0: "rows", 1: "transposed", 2: "rows+window", 3: "transposed+window", 4: "gtab", 6: "gtab+window"}
DEFAULT_VARIANT = 0
CALIBRATION_CANDIDATES = (0, 2, 4, 6)  # the transposed tables lost everywhere they were timed
_chosen: dict[tuple, int] = {}  # geometry -> the variant calibration picked

_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = cuda_build.load("cachegen_cuda").lib
        u32, u64, i32, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
        lib.cgc_encode_scratch_bytes.restype = u64
        lib.cgc_encode_scratch_bytes.argtypes = [u32, u32, i32]
        lib.cgc_decode_scratch_bytes.restype = u64
        lib.cgc_decode_scratch_bytes.argtypes = [u32, u32, i32, i32]
        lib.cgc_encode_sections.restype = i32
        lib.cgc_encode_sections.argtypes = [vp, vp, u32, u32, u32, vp]
        lib.cgc_assemble_sections.restype = i32
        lib.cgc_assemble_sections.argtypes = [vp, vp, u32, vp, vp]
        lib.cgc_decode_tables_in_smem.restype = i32
        lib.cgc_decode_tables_in_smem.argtypes = [u32, i32]
        lib.cgc_decode_gtab_in_smem.restype = i32
        lib.cgc_decode_gtab_in_smem.argtypes = [u32, i32]
        lib.cgc_decode_sections.restype = i32
        lib.cgc_decode_sections.argtypes = [vp, vp, u32, u32, i32, i32, i32, vp]
        lib.cgc_decode_error_string.restype = ctypes.c_char_p
        lib.cgc_decode_error_string.argtypes = [i32]
        lib.cgc_last_error.restype = ctypes.c_char_p
        lib.cgc_last_error.argtypes = []
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"kvtool CUDA CacheGen {what}: {library().cgc_last_error().decode(errors='replace')}")


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _upload(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(arr.view(np.uint8).copy()).to(device)


def _layout_scratch(sizes: Sequence[int]) -> tuple[np.ndarray, int]:
    offs = np.zeros(len(sizes), dtype=np.uint64)
    total = 0
    for i, s in enumerate(sizes):
        offs[i] = total
        total += (int(s) + 255) & ~255
    return offs, max(total, 256)


# --------------------------------------------------------------------------- encode

def _check_chunk(kv: Any) -> tuple[int, int, int]:
    L, T, C = check_chunk(kv)  # the same limits as the CPU coder
    if kv.device.type != "cuda":
        raise UsageError(f"cachegen GPU encode needs a CUDA tensor, got {kv.device}")
    return L, T, C


def encode_chunks(kvs: Sequence[torch.Tensor], params: dict | None = None) -> tuple[list[bytes], dict]:
    """Encode CUDA chunks [2, L, T, C] (one dtype and device) in one batch.
    Returns the payloads (bytes, identical to the CPU coder's) and the resolved
    params (as `cachegen_encode` returns them)."""
    if not kvs:
        return [], validate_params(params if params is not None else default_params())
    lib = library()
    p = validate_params(params if params is not None else default_params())
    spec = p["bins"]
    dev = kvs[0].device
    dtype = kvs[0].dtype
    chunks = []
    for kv in kvs:
        L, T, C = _check_chunk(kv)
        if kv.device != dev or kv.dtype != dtype:
            raise UsageError("cachegen: a batch must be of one dtype and device")
        bins = resolve_bins(spec, L)
        chunks.append((kv.contiguous(), L, T, C, bins))
    p["bins"] = canonical_bins_spec(spec, chunks[0][1])
    dc = DTYPE_CODE_OF[str(dtype).removeprefix("torch.")]
    es = itemsize(dtype)
    P = p["prob_bits"]
    out: list[bytes] = []
    # sections of whole chunks, at most MAX_SECTIONS per launch
    i = 0
    with torch.cuda.device(dev):
        while i < len(chunks):
            j, n = i, 0
            while j < len(chunks) and (n == 0 or n + 2 * chunks[j][1] <= MAX_SECTIONS):
                n += 2 * chunks[j][1]
                j += 1
            out += _encode_batch(lib, chunks[i:j], dc, es, P, p["lanes"], dev)
            i = j
    for payload, (_, _, _, C, bins) in zip(out, chunks):  # as the CPU encoder (cachegen.md section 8)
        check_table_budget(len(payload), C, [b // 2 - 1 for b in bins], writing=True)
    return out, p


def _encode_batch(lib, chunks, dc: int, es: int, P: int, lanes: int, dev: torch.device) -> list[bytes]:
    rows = []
    for kv, L, T, C, bins in chunks:
        N = min(lanes, C)
        base = kv.data_ptr()
        for l in range(2 * L):
            M = bins[l] // 2 - 1
            rows.append((base + l * T * C * es, T, C, M, N))
    nsec = len(rows)
    secs = np.zeros(nsec, dtype=SECTION_DTYPE)
    sizes = [lib.cgc_encode_scratch_bytes(T, C, M) for (_, T, C, M, _) in rows]
    offs, total = _layout_scratch(sizes)
    scratch = torch.empty(total, dtype=torch.uint8, device=dev)
    sbase = scratch.data_ptr()
    for k, (src, T, C, M, N) in enumerate(rows):
        secs[k] = (src, 0, sbase + int(offs[k]), 0, T, C, M, P, N, dc, 0, 0)
    d_secs = _upload(secs, dev)
    d_res = torch.zeros(nsec * RESULT_DTYPE.itemsize, dtype=torch.uint8, device=dev)
    stream = _stream(dev)
    max_T = max(r[1] for r in rows)
    max_C = max(r[2] for r in rows)
    _check(lib.cgc_encode_sections(d_secs.data_ptr(), d_res.data_ptr(), nsec, max_T, max_C, stream), "encode")
    res = d_res.cpu().numpy().view(RESULT_DTYPE).copy()  # synchronises
    if np.any(res["err"] != 0):
        raise NonFiniteValues("cachegen: the KV input holds NaN or infinity")
    side_bytes = ((res["side_bits"] + 31) // 32) * 4
    lens = (side_bytes + 4 * secs["N"].astype(np.uint64) + 2 * res["nwords"].astype(np.uint64) + 3) & ~np.uint64(3)
    if np.any(lens > 0xFFFFFFFF):
        raise UsageError("cachegen: layer section over 4 GiB")
    ends = np.cumsum(lens, dtype=np.uint64)
    res["out_len"] = lens
    res["out_offset"] = ends - lens
    total_out = int(ends[-1])
    d_out = torch.empty(max(total_out, 4), dtype=torch.uint8, device=dev)
    d_res2 = _upload(res, dev)
    _check(lib.cgc_assemble_sections(d_secs.data_ptr(), d_res2.data_ptr(), nsec, d_out.data_ptr(), stream), "assemble")
    host = torch.empty(total_out, dtype=torch.uint8, pin_memory=True)
    host.copy_(d_out[:total_out])  # synchronous: the kernels are done when it returns
    blob = host.numpy().tobytes()
    payloads = []
    k = 0
    for kv, L, T, C, bins in chunks:
        n = 2 * L
        sl = [int(x) for x in lens[k:k + n]]
        a, b = int(res["out_offset"][k]), int(res["out_offset"][k + n - 1] + lens[k + n - 1])
        payloads.append(build_header(dc, P, min(rows[k][4], C), T, C, [bb // 2 - 1 for bb in bins], sl) + blob[a:b])
        k += n
    del scratch
    return payloads


def encode(kv: torch.Tensor, params: dict | None = None) -> tuple[bytes, dict]:
    """One chunk: the GPU twin of `cpu.cachegen_encode`."""
    payloads, p = encode_chunks([kv], params)
    return payloads[0], p


# --------------------------------------------------------------------------- decode

class DecodePlan:
    """Payloads parsed and uploaded, outputs and scratch allocated: `run()`
    launches the decoder (asynchronous; repeatable, e.g. for timing),
    `check()` waits and raises DecodeError for a corrupt section."""

    def __init__(self, lib, metas, outs, d_pl, host, scratch, d_secs, errs, nsec, max_C, max_M, wpb, dev,
                 variant=DEFAULT_VARIANT):
        self.variant = variant
        self.lib, self.metas, self.outs, self.dev = lib, metas, outs, dev
        self._keep = (d_pl, host, scratch)
        self.d_secs, self.errs, self.nsec, self.max_C, self.max_M, self.wpb = d_secs, errs, nsec, max_C, max_M, wpb
        self.tables = "gtab" if variant & VAR_GTAB else "smem" if wpb else "global"

    def run(self) -> None:
        with torch.cuda.device(self.dev):
            _check(self.lib.cgc_decode_sections(self.d_secs.data_ptr(), self.errs.data_ptr(), self.nsec, self.max_C,
                                                self.max_M, self.wpb, self.variant, _stream(self.dev)), "decode")

    def check(self) -> list[torch.Tensor]:
        e = self.errs.cpu().numpy()  # synchronises
        bad = np.nonzero(e)[0]
        if bad.size:
            k = int(bad[0])
            ci = 0
            while k >= 2 * self.metas[ci][0][1]:
                k -= 2 * self.metas[ci][0][1]
                ci += 1
            msg = self.lib.cgc_decode_error_string(int(e[bad[0]])).decode()
            where = f"chunk {ci}, " if len(self.metas) > 1 else ""
            raise DecodeError(f"cachegen: {where}layer {k}: {msg}")
        return [o.view(shp) for o, (shp, _) in zip(self.outs, self.metas)]


def _upload_payloads(payloads, sizes, starts, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The payloads, each at its 4-byte aligned start, copied to one device buffer through a pinned
    one (kvtool.pinned: kept between decodes; allocating and zeroing pinned memory per batch cost
    more than the copy). Payloads read straight into a pinned buffer at those starts (the load
    path does) go up from there, not copied again. Returns (the pinned buffer, the device buffer)."""
    total = int(starts[-1]) or 4
    lease = _holding_in_place(payloads, starts, total)
    if lease is None:
        lease = pinned.take(total, dev)
        hv = lease.buffer.numpy()
        for pl, a, s in zip(payloads, starts[:-1], sizes):
            hv[a:a + s] = np.frombuffer(pl, dtype=np.uint8)
            hv[a + s:(a + s + 3) & ~3] = 0  # the padding to the next start
    host = lease.buffer
    d_pl = host[:total].to(dev, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(dev))
    pinned.give(lease, copied)
    return host, d_pl


def _holding_in_place(payloads, starts, total: int) -> "pinned.Lease | None":
    """The lease of the pinned buffer that holds every payload at its start already, if one does."""
    addresses = [np.frombuffer(pl, dtype=np.uint8).ctypes.data for pl in payloads]
    lease = pinned.holding(addresses[0])
    if lease is None or lease.given or lease.buffer.numel() < total:
        return None
    base = lease.buffer.data_ptr()
    return lease if all(a == base + int(s) for a, s in zip(addresses, starts[:-1])) else None


def section_table(metas, out_addresses: Sequence[int], payloads_address: int, starts: np.ndarray, es: int,
                  dtype_code: int, scratch_bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """The decode launch's section table (SECTION_DTYPE, one row per layer section of each chunk,
    in order; its `scratch` column left 0), each section's scratch offset (256-byte aligned) and
    the scratch's total bytes. `metas`: (shape, payload header) per chunk; `scratch_bytes(T, C, M)`:
    what one section needs. Built a column at a time: a row at a time it took ~12 ms for 32
    chunks of 64 sections, on the load's critical path (`section_rows` is that row-at-a-time
    reference, for the tests)."""
    columns: dict[str, list[np.ndarray]] = {name: [] for name in ("src", "dst", "src_len", "T", "C", "M", "P", "N")}
    for ((_, L, T, C), hdr), out, base in zip(metas, out_addresses, starts[:-1]):
        n = 2 * L
        columns["src"].append(np.asarray(hdr.offsets[:n], dtype=np.uint64) + np.uint64(payloads_address + int(base)))
        columns["dst"].append(np.uint64(out) + np.arange(n, dtype=np.uint64) * np.uint64(T * C * es))
        columns["src_len"].append(np.asarray(hdr.lengths[:n], dtype=np.uint64))
        columns["T"].append(np.full(n, T, dtype=np.uint32))
        columns["C"].append(np.full(n, C, dtype=np.uint32))
        columns["M"].append(np.asarray(hdr.half_ranges[:n], dtype=np.int32))
        columns["P"].append(np.full(n, hdr.prob_bits, dtype=np.int32))
        columns["N"].append(np.full(n, hdr.lanes, dtype=np.int32))
    secs = np.zeros(sum(len(c) for c in columns["T"]), dtype=SECTION_DTYPE)
    for name, parts in columns.items():
        secs[name] = np.concatenate(parts)
    secs["dtype"] = dtype_code
    keys = list(zip(secs["T"].tolist(), secs["C"].tolist(), secs["M"].tolist()))
    needed = {key: scratch_bytes(*key) for key in set(keys)}
    padded = (np.array([needed[key] for key in keys], dtype=np.uint64) + np.uint64(255)) & ~np.uint64(255)
    offs = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.uint64)
    return secs, offs, max(int(padded.sum()), 256)


def section_rows(metas, out_addresses: Sequence[int], payloads_address: int, starts: np.ndarray, es: int,
                 dtype_code: int, scratch_bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """`section_table`, a row at a time (the reference)."""
    rows = []
    for ((_, L, T, C), hdr), out, base in zip(metas, out_addresses, starts[:-1]):
        for l in range(2 * L):
            rows.append((payloads_address + int(base) + hdr.offsets[l], out + l * T * C * es, hdr.lengths[l], T, C,
                         hdr.half_ranges[l], hdr.prob_bits, hdr.lanes))
    offs, total = _layout_scratch([scratch_bytes(r[3], r[4], r[5]) for r in rows])
    secs = np.zeros(len(rows), dtype=SECTION_DTYPE)
    for k, (src, dst, ln, T, C, M, P, N) in enumerate(rows):
        secs[k] = (src, dst, 0, ln, T, C, M, P, N, dtype_code, 0, 0)
    return secs, offs, total


def plan_decode(payloads: Sequence[bytes | memoryview], shapes: Sequence[Any], dtype: torch.dtype, params: dict,
                device: Any = "cuda", tables: str = "auto", outs: Sequence[torch.Tensor] | None = None,
                variant: int | None = None) -> DecodePlan:
    """Validate the payload headers (as the CPU decoder does), upload the
    payloads and lay out the work; see DecodePlan."""
    lib = library()
    p = validate_params(params)
    if str(dtype).removeprefix("torch.") not in DTYPE_CODE_OF:
        raise DecodeError(f"cachegen: unsupported KV dtype {dtype}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise UsageError(f"cachegen GPU decode needs a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dc = DTYPE_CODE_OF[str(dtype).removeprefix("torch.")]
    es = itemsize(dtype)
    if len(payloads) != len(shapes) or not payloads:
        raise UsageError("cachegen: one shape per payload, at least one payload")
    metas = []
    for pl, shape in zip(payloads, shapes):
        shp = check_shape(shape)
        _, L, T, C = shp
        try:
            bins = resolve_bins(p["bins"], L)
        except UsageError as exc:
            raise CodecParamsInvalid(str(exc)) from None
        hdr = parse_header(pl, 2 * L, T, C, dc, [b // 2 - 1 for b in bins])
        if hdr.prob_bits != p["prob_bits"] or hdr.lanes != min(p["lanes"], C):
            raise DecodeError("cachegen: payload header disagrees with the codec parameters (prob_bits/lanes)")
        metas.append((shp, hdr))
    if outs is None:
        outs = [torch.empty(shp, dtype=dtype, device=dev) for shp, _ in metas]
    # one device buffer of all payloads (each a multiple of 4 bytes long)
    sizes = [len(pl) for pl in payloads]
    starts = np.concatenate([[0], np.cumsum([(s + 3) & ~3 for s in sizes])]).astype(np.int64)
    host, d_pl = _upload_payloads(payloads, sizes, starts, dev)
    max_C = max(m[0][3] for m in metas)
    max_M = max(max(h.half_ranges) for _, h in metas)
    variant = DEFAULT_VARIANT if variant is None else int(variant)
    if variant not in DECODE_VARIANTS:
        raise UsageError(f"cachegen: decoder variant must be one of {sorted(DECODE_VARIANTS)}, got {variant}")
    if tables not in ("auto", "smem", "global"):
        raise UsageError(f"cachegen: tables must be 'auto', 'smem' or 'global', got {tables!r}")
    with torch.cuda.device(dev):  # shared memory limits of this device
        fit_gtab, fit_tables = lib.cgc_decode_gtab_in_smem(max_C, max_M), lib.cgc_decode_tables_in_smem(max_C, max_M)
    if variant & VAR_GTAB:  # its tables always live in shared memory
        wpb = fit_gtab
        if wpb == 0:
            raise UsageError("cachegen: the Gaussian decoder tables do not fit in shared memory for this geometry")
    else:
        wpb = fit_tables
        if tables == "global" or (tables == "auto" and wpb < 4):
            wpb = 0  # auto: shared memory only when it does not cost resident warps (measured on an H100)
        elif tables == "smem" and wpb == 0:
            raise UsageError("cachegen: the decoder tables do not fit in shared memory for this geometry")
    for (shp, _), out in zip(metas, outs):
        if tuple(out.shape) != shp or out.dtype != dtype or out.device != dev or not out.is_contiguous():
            raise UsageError("cachegen: output tensor does not match the shape/dtype/device")
    secs, offs, total = section_table(metas, [o.data_ptr() for o in outs], d_pl.data_ptr(), starts, es, dc,
                                      lambda T, C, M: lib.cgc_decode_scratch_bytes(T, C, M, 0 if wpb else 1))
    scratch = torch.empty(total, dtype=torch.uint8, device=dev)
    secs["scratch"] = np.uint64(scratch.data_ptr()) + offs
    rows = secs
    errs = torch.zeros(len(rows), dtype=torch.int32, device=dev)
    d_secs = _upload(secs, dev)
    return DecodePlan(lib, metas, list(outs), d_pl, host, scratch, d_secs, errs, len(rows), max_C, max_M, wpb, dev,
                      variant)


def decode_chunks(payloads: Sequence[bytes | memoryview], shapes: Sequence[Any], dtype: torch.dtype, params: dict,
                  device: Any = "cuda", tables: str = "auto", outs: Sequence[torch.Tensor] | None = None,
                  variant: int | None = None) -> list[torch.Tensor]:
    """Decode payloads on the GPU into new (or the given) CUDA tensors of
    `shapes`, all sections in one launch; DecodeError on any corruption, with
    the CPU decoder's message. tables: 'auto', 'smem' or 'global' (where the
    frequency tables live; a benchmark knob). variant: a decoder variant (same
    output, different speed); None: KVTOOL_CACHEGEN_GPU_VARIANT, else the one
    calibration picks for this geometry."""
    if variant is None:
        variant = chosen_variant(payloads, shapes, dtype, params, device, tables)
    plan = plan_decode(payloads, shapes, dtype, params, device=device, tables=tables, outs=outs, variant=variant)
    plan.run()
    return plan.check()


def geometry_key(shapes: Sequence[Any], dtype: torch.dtype, params: dict, device: Any) -> tuple:
    """What the decoder's speed depends on: the device, the dtype and parameters, each chunk's
    (layers, channels), and the batch's tokens and chunk count to the next power of two."""
    dims = sorted({(int(s[1]), int(s[3])) for s in shapes})
    tokens = max(int(s[2]) for s in shapes)
    dev = torch.device(device)
    return (dev.index if dev.index is not None else torch.cuda.current_device(), str(dtype), repr(sorted(params.items())),
            tuple(dims), 1 << max(tokens - 1, 0).bit_length(), 1 << max(len(shapes) - 1, 0).bit_length())


def chosen_variant(payloads: Sequence[bytes | memoryview], shapes: Sequence[Any], dtype: torch.dtype, params: dict,
                   device: Any = "cuda", tables: str = "auto", reps: int = 2) -> int:
    """The decoder variant for this geometry: KVTOOL_CACHEGEN_GPU_VARIANT if set, else the fastest
    of CALIBRATION_CANDIDATES on this very batch (each decoded `reps` times, kernel time by CUDA
    events; a variant whose tables do not fit is skipped), remembered per `geometry_key`."""
    import os

    forced = os.environ.get("KVTOOL_CACHEGEN_GPU_VARIANT", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) not in DECODE_VARIANTS:
            raise UsageError(f"KVTOOL_CACHEGEN_GPU_VARIANT must be one of {sorted(DECODE_VARIANTS)}, got {forced!r}")
        return int(forced)
    key = geometry_key(shapes, dtype, params, device)
    if key in _chosen:
        return _chosen[key]
    saved = _saved_choices()
    name = _choice_name(key)
    if saved.get(name) in DECODE_VARIANTS:
        _chosen[key] = saved[name]
        return saved[name]
    timings: dict[int, float] = {}
    for candidate in CALIBRATION_CANDIDATES:
        try:
            plan = plan_decode(payloads, shapes, dtype, params, device=device, tables=tables, variant=candidate)
        except UsageError:  # its tables do not fit this geometry
            continue
        plan.run()  # warm-up (and a bad payload fails here, as it would below)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            plan.run()
        end.record()
        end.synchronize()
        timings[candidate] = start.elapsed_time(end)
    best = min(timings, key=timings.get) if timings else DEFAULT_VARIANT
    _chosen[key] = best
    _save_choice(name, best)
    return best


# Calibration takes ~0.5 s a geometry (every candidate decodes the batch three times): a replay or
# an engine starting afresh would pay it each time. The choices are kept beside the built kernels,
# per GPU model, kernel build and geometry (the device index left out).
_CHOICES_FILE = "cachegen-variants.json"


def _choice_name(key: tuple) -> str:
    device = torch.device("cuda", key[0])
    built = cuda_build.cached_path("cachegen_cuda")
    return "|".join([torch.cuda.get_device_name(device), built.name if built else "?", *map(repr, key[1:])])


def _saved_choices() -> dict:
    import json

    try:
        saved = json.loads((cuda_build.cache_dir() / _CHOICES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _save_choice(name: str, variant: int) -> None:
    """Best effort: a cache that cannot be written is calibrated again next time."""
    import json

    from ...fsutil import atomic_write

    saved = _saved_choices()
    saved[name] = variant
    try:
        cuda_build.cache_dir().mkdir(parents=True, exist_ok=True)
        atomic_write(cuda_build.cache_dir() / _CHOICES_FILE,
                     lambda f: f.write(json.dumps(saved, indent=1, sort_keys=True).encode()))
    except OSError:
        pass


def decode(payload: bytes | memoryview, shape: Any, dtype: torch.dtype, params: dict, device: Any = "cuda",
           tables: str = "auto", variant: int | None = None) -> torch.Tensor:
    """One payload: the GPU twin of `cpu.cachegen_decode` (output on the GPU)."""
    return decode_chunks([payload], [shape], dtype, params, device=device, tables=tables, variant=variant)[0]
