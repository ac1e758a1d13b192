"""Loading KV into paged buffers: kvtool's load path next to its peers and the machine's limits.

    python bench/bench_load.py [--quick] [--rounds 5] [--json OUT] [--dir TMP]

No model weights: random KV in the geometry of the default model (SmolLM2-135M: 30 layers x 3 KV
heads x 64) and of an 8B model (Llama-3-8B: 32 x 8 x 128), bf16, 2,048 and 8,192 tokens
(--quick: 2,048 only), in raw, zstd and cachegen files of 256-token chunks and in a local chunk
store (raw), all in the page cache. Each is loaded into kvtool's own paged buffers (flash_attn
layout, block size 16, shuffled blocks), every chunk CRC-checked, side by side in one run:

  before      the path before kvtool.load: chunk by chunk, read_chunk (a copy), then a staging
              copy, then the torch scatter (KVTOOL_PAGED_NATIVE=0, one thread)
  pipeline    kvtool.load: worker threads check, decode and scatter chunk by chunk; raw chunks
              go from the mapped file into the paged buffers in one pass, CRC-32C computed as
              they are copied ("pread + CRC + scatter": the earlier three passes: a pread into
              a reused buffer, the CRC, the native row copy)
  store       ModelCache.load_prefix from a local store (the same pipeline over store objects:
              each object opened and checked, its raw payload CRC-32C-checked as it is
              scattered: from the file's mapping behind a fault guard from 16 MiB up, below
              that read with pread a window at a time into a cache-sized buffer; "every
              payload mapped" and "every payload in windows" force one way; "manifests parsed
              afresh": no manifest kept from an earlier load (a process's first load of the
              prefix); "objects checked afresh": no object's checks 1-10 kept from an earlier
              load (a hot prefix's objects, unchanged since, skip them; the payload is checked as
              copied either way); "objects read whole": every object read into a buffer, then
              checked as it is scattered, as before either)
  128-bit fold the pipeline with CRC-32C's 128-bit PCLMULQDQ fold forced, where the CPU has the
              256-bit VPCLMULQDQ one (which it uses otherwise)
  safetensors safetensors.torch.load_file of the same KV as one tensor, then the same scatter
              into the paged buffers (what a user of safetensors would do; no CRC)
  limits      a plain copy of the same bytes (torch, dst.copy_(src)); preads of the raw file into
              one buffer (page cache -> memory, one thread); the page-in of a fresh map of the raw
              file (map it, touch each page, one thread: what a load from the map pays first, in
              page-table work the plain copy of bytes already in memory does not do)

GB/s are of decoded KV bytes, from each candidate's best time; "vs copy" is the median over
rounds of the plain copy's time over the candidate's in the same round (this host's memory speed
changes phase within minutes, so best times of the two may come from different phases). A last table times the vLLM
connector's copies into and out of vLLM's CPU layout, native vs the torch reference. On a GPU
(when torch sees one) the same files load into paged buffers on the device ("gpu" rows): the
staged loader (pinned buffers filled and checked by worker threads, copies and scatters on a side
stream; also with the old 3 buffers and threads), CacheGen decoded on the GPU in batches, safetensors
load_file + .to(cuda), next to a pinned host-to-device copy of the same bytes ("vs copy" there).
Goals (the load issue): CPU raw >= 0.8x the plain copy; GPU raw >= 25 GB/s; GPU cachegen >= 40 GB/s
of decoded KV.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# torch's OpenMP threads sleep when idle instead of spinning: a candidate timed right after a
# torch copy would otherwise share the cores with its spinning threads (measured: the file load
# 1.5x slower right after the copy than alone). The copy itself is no slower so.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(REPO))

import numpy  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvtool.connectors import PagedMemConnectorV2, paged_native  # noqa: E402
from kvtool.format import ContainerReader, ContainerWriter  # noqa: E402
from kvtool.identity import ModelIdentity  # noqa: E402
from kvtool.load import Destination, file_tasks, load_chunks  # noqa: E402
from kvtool.store import open_store  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from bench_connectors import paired_ratio, time_rounds  # noqa: E402

SHAPES = {"SmolLM2-135M": (30, 3, 64), "8B (Llama-3-8B)": (32, 8, 128)}
CHUNK, BLOCK = 256, 16


def identity(name: str, layers: int, heads: int, head_dim: int) -> ModelIdentity:
    return ModelIdentity(name=name, architecture="LlamaForCausalLM", num_layers=layers,
                         num_attention_heads=heads * 4, num_kv_heads=heads, head_dim=head_dim,
                         hidden_size=heads * 4 * head_dim, intermediate_size=8 * heads * head_dim,
                         vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope={"rope_theta": 500000.0, "rope_scaling": None})


class Paged:
    """kvtool engine-style paged buffers (flash_attn) for `tokens` tokens, shuffled blocks."""

    def __init__(self, layers: int, heads: int, head_dim: int, tokens: int, device: str = "cpu"):
        blocks = tokens // BLOCK + 1
        self.caches = [torch.zeros(2, blocks, BLOCK, heads, head_dim, dtype=torch.bfloat16, device=device)
                       for _ in range(layers)]
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))
        t = torch.arange(tokens)
        self.slots = order[t // BLOCK] * BLOCK + t % BLOCK  # on the host: the connector checks them there
        self.connector = PagedMemConnectorV2(heads * head_dim, layers, layout="flash_attn", num_kv_heads=heads,
                                             head_dim=head_dim, use_gpu=device != "cpu")
        # the load's destination: raw chunks copied from their stored bytes, CRC-checked as copied
        self.target = self.connector.target(kvcaches=self.caches, slot_mapping=self.slots)
        # one that takes decoded KV only: raw chunks copied privately (the load thread's reused
        # buffer) and CRC-checked first
        self.checked_first = _DecodedOnly(self)

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.connector.scatter(kv, start, end, kvcaches=self.caches, slot_mapping=self.slots)

    def gather(self, tokens: int) -> torch.Tensor:
        out = torch.empty(self.connector.get_shape(tokens), dtype=torch.bfloat16)
        self.connector.gather(out, 0, tokens, kvcaches=self.caches, slot_mapping=self.slots)
        return out


class _DecodedOnly(Destination):
    """A load destination that takes decoded KV only: every chunk comes decoded (checked first)."""

    def __init__(self, paged: "Paged"):
        self.device, self.paged = paged.target.device, paged

    def scatter(self, kv: torch.Tensor, start: int, end: int) -> None:
        self.paged.scatter(kv, start, end)


def before(reader: ContainerReader, paged: Paged, tokens: int) -> None:
    """The load path before kvtool.load (ops.replay's loop): one chunk at a time, torch scatter."""
    previous = os.environ.get("KVTOOL_PAGED_NATIVE")
    os.environ["KVTOOL_PAGED_NATIVE"] = "0"
    try:
        for chunk in reader.chunks:
            decoded = reader.read_chunk(chunk.index)
            end = min(chunk.end, tokens)
            memory = paged.connector.allocate(end - chunk.start, decoded.dtype)
            memory.tensor.copy_(decoded[:, :, :end - chunk.start])
            paged.connector.to_gpu(memory, chunk.start, end, kvcaches=paged.caches, slot_mapping=paged.slots)
    finally:
        if previous is None:
            del os.environ["KVTOOL_PAGED_NATIVE"]
        else:
            os.environ["KVTOOL_PAGED_NATIVE"] = previous


def pipeline(path: Path, paged: Paged, tokens: int, fused: bool = True) -> None:
    with ContainerReader(path) as reader:
        outcome = load_chunks(file_tasks(reader, tokens), paged.target if fused else paged.checked_first)
    assert outcome.error is None and outcome.loaded_tokens == tokens, outcome


def preads(path: Path, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.readinto(view)


def page_in(path: Path) -> None:
    """Map the file and touch each of its pages, as a load from the map does first (one thread)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        pages = numpy.frombuffer(mapped, dtype=numpy.uint8)[::mmap.PAGESIZE]
        int(pages.sum())
        del pages


def map_from(bytes_: int, fn):
    """`fn` with store payloads mapped from `bytes_` up and read a window at a time below."""
    native = paged_native.native_module()

    def run():
        threshold = native.map_min_bytes(bytes_)
        try:
            fn()
        finally:
            native.map_min_bytes(threshold)
    return run


def fresh_manifests(fn):
    """`fn` with every manifest parsed and checked afresh (a process's first load of a prefix),
    not taken from those kept by earlier loads (format.reader.parsed_manifest)."""
    from kvtool.format import reader

    def run():
        reader._parsed_manifest_kept.cache_clear()
        fn()
    return run


def objects_checked_afresh(fn):
    """`fn` with no object's checks kept from an earlier load (kvtool.store.loading: a hot
    prefix's objects, opened again, skip checks 1-10; their payloads are checked as copied)."""
    from kvtool.store import loading

    def run():
        loading.forget_checked()
        fn()
    return run


def whole_objects(fn, backend):
    """`fn` with the store's objects read whole into a buffer (as before they were opened)."""
    def run():
        backend.open = backend.get  # (an instance attribute over the class's method)
        try:
            fn()
        finally:
            del backend.open
    return run


def no_finiteness_scan(fn):
    """`fn` with the scan for NaN and infinity turned off (the load path before the hostile-input
    issue): the paired "before" of the rows that scan."""
    from kvtool.chunk_source import ChunkSource

    def run():
        real = ChunkSource._finite_kind
        ChunkSource._finite_kind = lambda self: 0
        try:
            fn()
        finally:
            ChunkSource._finite_kind = real
    return run


def crc_level(level: int, fn):
    """`fn` with the native CRC-32C held to `level` (2: the 128-bit PCLMULQDQ fold)."""
    native = paged_native.native_module()

    def run():
        best = native.crc32c_level()
        native.crc32c_set_level(level)
        try:
            fn()
        finally:
            native.crc32c_set_level(best)
    return run


def run_geometry(name: str, layers: int, heads: int, head_dim: int, tokens: int, tmp: Path, rounds: int,
                 gpu_only: bool = False) -> list[dict]:
    ident = identity(name, layers, heads, head_dim)
    gen = torch.Generator().manual_seed(tokens)
    kv = (torch.randn(2, layers, tokens, heads * head_dim, generator=gen) * 2).to(torch.bfloat16)
    token_ids = [(7 * i + 3) % 32000 for i in range(tokens)]
    nbytes = kv.numel() * kv.element_size()
    files = {}
    for codec in ("raw", "zstd", "cachegen"):
        files[codec] = tmp / f"{codec}.kvc"
        with ContainerWriter(files[codec], ident, token_ids, kv_dtype=torch.bfloat16, chunk_size=CHUNK) as w:
            for s, e in w.chunk_ranges():
                w.write_chunk(kv[:, :, s:e], codec)
    save_file({"kv": kv}, str(tmp / "kv.safetensors"))
    store_cache = open_store(tmp / "store").for_model(ident, CHUNK)
    store_cache.put_sequence(token_ids, kv)
    whole = tokens // CHUNK * CHUNK
    paged = Paged(layers, heads, head_dim, tokens)
    src, dst, buffer = kv.clone(), torch.empty_like(kv), torch.empty(files["raw"].stat().st_size, dtype=torch.uint8)
    fns = {"limit: copy of the same bytes": lambda: dst.copy_(src),
           "limit: pread of the raw file": lambda: preads(files["raw"], buffer),
           "limit: page-in of the mapped raw file": lambda: page_in(files["raw"]),
           "safetensors load_file + scatter": lambda: paged.scatter(load_file(str(tmp / "kv.safetensors"))["kv"], 0, tokens)}
    for codec, path in files.items():
        reader = ContainerReader(path)
        fns[f"{codec}: before"] = lambda r=reader: before(r, paged, tokens)
        fns[f"{codec}: pipeline"] = lambda p=path: pipeline(p, paged, tokens)
    fns["raw: pipeline, pread + CRC + scatter"] = lambda: pipeline(files["raw"], paged, tokens, fused=False)
    fns["raw: pipeline, without the NaN/inf scan"] = no_finiteness_scan(lambda: pipeline(files["raw"], paged, tokens))
    fns["raw: store load_prefix"] = lambda: store_cache.load_prefix(token_ids, paged.target)
    fns["raw: store load_prefix, without the NaN/inf scan"] = no_finiteness_scan(
        lambda: store_cache.load_prefix(token_ids, paged.target))
    fns["raw: store load_prefix, manifests parsed afresh"] = fresh_manifests(
        lambda: store_cache.load_prefix(token_ids, paged.target))
    fns["raw: store load_prefix, objects checked afresh"] = objects_checked_afresh(
        lambda: store_cache.load_prefix(token_ids, paged.target))
    fns["raw: store load_prefix, objects read whole"] = whole_objects(
        lambda: store_cache.load_prefix(token_ids, paged.target), store_cache.backend)
    native = paged_native.native_module()
    if native is not None:
        fns["raw: store load_prefix, every payload mapped"] = map_from(
            0, lambda: store_cache.load_prefix(token_ids, paged.target))
        fns["raw: store load_prefix, every payload in windows"] = map_from(
            1 << 62, lambda: store_cache.load_prefix(token_ids, paged.target))
    if native is not None and native.crc32c_level() > 2:
        fns["raw: pipeline, 128-bit CRC fold"] = crc_level(2, lambda: pipeline(files["raw"], paged, tokens))
    if torch.cuda.is_available():
        fns.update(gpu_candidates(kv, files, tmp, store_cache, token_ids, layers, heads, head_dim, tokens))
    if gpu_only:
        fns = {what: fn for what, fn in fns.items() if what.startswith("gpu") or what == "limit: copy of the same bytes"}
    times = time_rounds(fns, rounds)
    pipeline(files["raw"], paged, tokens)
    assert torch.equal(paged.gather(tokens), kv), "the pipeline loaded different KV"
    rows = []
    for what, seconds in times.items():
        moved = whole if "store" in what else tokens  # the store holds whole chunks only
        gbps = nbytes * moved / tokens / min(seconds) / 1e9
        copy = times["gpu limit: pinned host-to-device copy" if what.startswith("gpu") else "limit: copy of the same bytes"]
        rows.append({"geometry": name, "tokens": tokens, "what": what, "seconds": min(seconds), "GBps": gbps,
                     "vs_copy": paired_ratio(copy, seconds) * moved / tokens,
                     "copy_GBps": nbytes / min(copy) / 1e9, "bytes": nbytes})
    return rows


def gpu_candidates(kv, files, tmp, store_cache, token_ids, layers, heads, head_dim, tokens) -> dict:
    """The same loads into paged buffers on the GPU, each timed to the end of its device work;
    "vs copy" there divides by a pinned host-to-device copy of the same bytes."""
    from kvtool.load import load, load_chunks_staged

    device = torch.device("cuda")
    paged = Paged(layers, heads, head_dim, tokens, device="cuda")
    pinned, on_device = kv.pin_memory(), torch.empty_like(kv, device=device)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    def staged(path, **how):
        with ContainerReader(path) as reader:
            outcome = load_chunks_staged(file_tasks(reader, tokens), paged.target, device, **how)
        assert outcome.error is None and outcome.loaded_tokens == tokens, outcome

    def batched(path):  # replay's GPU path before the staged loader, and CacheGen's now (kvtool.load.load)
        with ContainerReader(path) as reader:
            outcome = load(file_tasks(reader, tokens), paged.target)
        assert outcome.error is None and outcome.loaded_tokens == tokens, outcome

    def grouped(size, fn):  # CacheGen chunks decoded `size` at a time (default: load.path.GPU_DECODE_BATCH)
        from kvtool.load import path

        def run():
            default, path.GPU_DECODE_BATCH = path.GPU_DECODE_BATCH, size
            try:
                fn()
            finally:
                path.GPU_DECODE_BATCH = default
        return run

    fns = {"gpu limit: pinned host-to-device copy": synced(lambda: on_device.copy_(pinned, non_blocking=True)),
           "gpu safetensors load_file + .to(cuda) + scatter": synced(
               lambda: paged.scatter(load_file(str(tmp / "kv.safetensors"))["kv"].to(device), 0, tokens)),
           "gpu raw: staged (pinned buffers, side stream)": synced(lambda: staged(files["raw"])),
           "gpu raw: staged, 3 buffers and threads": synced(lambda: staged(files["raw"], staging=3, threads=3)),
           "gpu zstd: staged": synced(lambda: staged(files["zstd"])),
           "gpu cachegen: batched GPU decode": synced(lambda: batched(files["cachegen"])),
           "gpu cachegen: batched GPU decode, groups of 16": synced(grouped(16, lambda: batched(files["cachegen"]))),
           "gpu cachegen: batched GPU decode, groups of 8": synced(grouped(8, lambda: batched(files["cachegen"]))),
           "gpu raw: store load_prefix (staged)": synced(lambda: store_cache.load_prefix(token_ids, paged.target))}
    staged(files["raw"])
    torch.cuda.synchronize()
    assert torch.equal(paged.gather(tokens).cpu(), kv), "the staged GPU load gave different KV"
    return fns


def vllm_cpu_layout(rounds: int) -> list[dict]:
    """The vLLM connector's copies (integrations.engine_blocks): 1,024 tokens (4 chunks) of the
    default model's float32 KV into vLLM's CPU layout as a load does it (`EngineBlocks.target`, each chunk
    CRC-checked as it is copied from its stored bytes) and out of it as a save does (`read` into a
    recycled buffer, `SaveBuffers`), the native copy vs the torch reference, next to a plain copy of
    the same bytes."""
    from kvtool.chunk_source import ChunkSource
    from kvtool.integrations.engine_blocks import EngineBlocks, SaveBuffers

    layers, heads, head_dim, block, tokens = 30, 3, 64, 128, 1024
    kv_numel = 2 * layers * CHUNK * heads * head_dim
    blocks = EngineBlocks([torch.zeros(182, heads, block, 2 * head_dim) for _ in range(layers)], block, "vllm_cpu")
    block_ids = [5, 77, 12, 140, 33, 9, 100, 150]
    stored = [torch.randn(2, layers, CHUNK, heads * head_dim) for _ in range(tokens // CHUNK)]  # "stored" chunks
    sources = [ChunkSource.from_tensor(kv, f"chunk {c}") for c, kv in enumerate(stored)]
    for source in sources:
        source.checked = False  # stored bytes: CRC-checked as they are copied
    target = blocks.target(block_ids, tokens)
    src, dst = torch.randn(2, layers, tokens, heads * head_dim), torch.empty(2, layers, tokens, heads * head_dim)

    def load():
        for c, source in enumerate(sources):
            target.scatter_source(source, c * CHUNK, (c + 1) * CHUNK)

    buffers = SaveBuffers()

    def save():  # as the connector saves: into a buffer an earlier save gave back
        for c in range(tokens // CHUNK):
            kv = blocks.read(block_ids, c * CHUNK, (c + 1) * CHUNK, into=buffers.take(kv_numel, torch.float32))
            buffers.give(kv)

    def torch_path(fn):
        def run():
            os.environ["KVTOOL_PAGED_NATIVE"] = "0"
            try:
                fn()
            finally:
                del os.environ["KVTOOL_PAGED_NATIVE"]
        return run

    times = time_rounds({"limit: copy of the same bytes": lambda: dst.copy_(src),
                         "load (target, checked), native": load,
                         "load (target, checked), torch reference": torch_path(load),
                         "save (read), native": save, "save (read), torch reference": torch_path(save)}, rounds)
    nbytes = src.numel() * 4
    copy = times["limit: copy of the same bytes"]
    return [{"what": k, "seconds": min(v), "GBps": nbytes / min(v) / 1e9, "vs_copy": paired_ratio(copy, v)}
            for k, v in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2,048 tokens only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--gpu-only", action="store_true", help="the GPU rows only (and the CPU copy limit)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtool-bench-load-", dir=args.dir))
    rows = []
    try:
        for name, (layers, heads, head_dim) in SHAPES.items():
            for tokens in ([2048] if args.quick else [2048, 8192]):
                print(f"… {name}, {tokens} tokens", file=sys.stderr, flush=True)
                rows += run_geometry(name, layers, heads, head_dim, tokens, tmp, args.rounds, args.gpu_only)
                for p in tmp.iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); bf16 KV, chunks of {CHUNK}, best of {args.rounds}\n")
    print("| geometry | tokens | what | MB | ms | GB/s | vs copy |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['geometry']} | {r['tokens']} | {r['what']} | {r['bytes'] / 1e6:,.0f} | {1e3 * r['seconds']:.1f} | "
              f"{r['GBps']:.2f} | {r['vs_copy']:.2f} |")
    cpu_rows = vllm_cpu_layout(args.rounds)
    print("\nvLLM's CPU layout (the vLLM connector's copies): 1,024 tokens of SmolLM2-135M float32 KV, "
          "4 chunks, 8 blocks of 128\n")
    print("| what | ms | GB/s | vs copy |")
    print("|---|---:|---:|---:|")
    for r in cpu_rows:
        print(f"| {r['what']} | {1e3 * r['seconds']:.1f} | {r['GBps']:.2f} | {r['vs_copy']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"load": rows, "vllm_cpu": cpu_rows}, indent=1))


if __name__ == "__main__":
    main()
