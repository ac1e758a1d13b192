"""Capture: run a model through a paged KV buffer and stream its KV into a file.

The KV leaves the engine the way it leaves a serving engine: chunk by chunk,
gathered from the paged buffer by `PagedMemConnectorV2.from_gpu` with the
sequence's full slot mapping. Prefill runs one chunk ahead of the writer, so a
chunk is on disk as soon as the model has produced it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import codecs
from ..devices import describe, resolve_device, synchronize
from ..dtypes import dtype_from_name
from ..engine import LoadedModel, PagedKVCache, Runner, load_model
from ..errors import PromptError, UsageError
from ..format import ContainerReader, ContainerWriter
from ..format.reader import BytesSource
from ..store import open_store
from ..store.containers import ingest
from ..store.names import ExtraKeys
from ..format.layout import MAX_CHUNK_SIZE
from ..format.segment import segment_extension
from ..fsutil import read_text_file
from ..load import SavePipeline
from .engine_io import paged_connector
from .inputs import check_text, check_vocabulary, codec_params, kv_dtype_name, model_dtype_name, parse_roi, read_token_file
from .result import Result


@dataclass
class CaptureTimings:
    prefill_s: float = 0.0
    connector_s: float = 0.0  # from_gpu: paged buffer -> KV_BLOB
    writer_s: float = 0.0  # encode + checksum + write, on the saving thread (overlaps the prefill)
    waiting_s: float = 0.0  # the prefill loop waiting for the saving thread, and the file's finish

    @property
    def overhead_share(self) -> float:
        """What capturing adds to the prefill's time: the gathers and the waits (the writes
        themselves overlap the next chunk's prefill)."""
        return (self.connector_s + self.waiting_s) / max(self.prefill_s, 1e-9)


@dataclass
class CaptureResult(Result):
    output: str | None  # None: only into the store
    model: str
    fingerprint: str
    num_tokens: int
    num_chunks: int
    chunk_size: int
    codec: str
    kv_dtype: str
    device: str
    model_dtype: str
    block_size: int
    extras: list[str]
    file_bytes: int
    decoded_bytes: int
    stored_bytes: int
    seconds: float
    prefill_tokens_per_s: float
    timings: dict[str, float] = field(default_factory=dict)
    # with a store: {"store": url, "chunks": whole chunks, "stored": written, "present": already there}
    store: dict[str, Any] | None = None
    # with segment: the file's `segment` key (format-spec/segment.md), {"version": 1, "stored_start": 0}
    segment: dict[str, int] | None = None


def read_tokens(model: LoadedModel, prompt: str | None = None, prompt_file: Path | None = None,
                tokens_file: Path | None = None, chat: bool = False) -> list[int]:
    """Token ids from exactly one of: a prompt, a prompt file, or a token-id file. With `chat`,
    the prompt is a user message in the model's chat template (as transformers applies it)."""
    given = [x is not None for x in (prompt, prompt_file, tokens_file)]
    if sum(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file or --tokens")
    if tokens_file is not None:
        if chat:
            raise UsageError("--chat formats a prompt; --tokens are token ids already")
        ids = read_token_file(tokens_file)
        check_vocabulary(ids, model.config.vocab_size)
    else:
        text = check_text(prompt if prompt is not None else read_text_file(prompt_file), "--prompt")
        ids = encode_prompt(model, text, chat)
    if not ids:
        raise PromptError("the prompt is empty")
    if len(ids) > model.max_position_embeddings:
        raise PromptError(f"the prompt has {len(ids)} tokens, more than the model's context of "
                          f"{model.max_position_embeddings}")
    return ids


def encode_prompt(model: LoadedModel, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, as plain text or (chat) as a user message in the model's chat template."""
    if chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return model.tokenizer.encode(text)


def capture_prompt(output: str | Path | None, *, prompt: str | None = None, prompt_file: Path | None = None,
                   tokens_file: Path | None = None, model: str | Path | LoadedModel | None = None,
                   codec: str = "raw", level: int | None = None, shuffle: bool | None = None,
                   bins: str | None = None, kv_dtype: str = "bf16", chunk_size: int = 256,
                   block_size: int = 16, hidden_states: bool = False, roi: str | None = None,
                   device: str = "auto", model_dtype: str = "fp32", chat: bool = False,
                   store: str | None = None, segment: bool = False, namespace: str | None = None,
                   on_chunk: Callable[[int, int, int], None] | None = None) -> CaptureResult:
    """`kvtool capture` as a function: options as the command line gives them, every one
    checked before the model loads; `on_chunk(index, tokens_done, tokens_total)` reports progress.
    `store` (a URL) also puts the whole chunks into the chunk store; without `output`, only there.
    `segment` marks the file a position-independent segment (format-spec/segment.md)."""
    if output is None and store is None:
        raise UsageError("give -o OUT, --store URL, or both")
    if namespace is not None and store is None:
        raise UsageError("--namespace names a partition of the store: give --store URL")
    ExtraKeys(namespace=namespace or "")  # a bad namespace fails before the model loads
    if segment and chat:
        raise UsageError("--segment is text to place inside other prompts: --chat would wrap it in a chat template")
    if segment and hidden_states:
        raise UsageError("--segment and --hidden-states: a segment's hidden states are not those of a prompt it is "
                         "placed in")
    kv = dtype_from_name(kv_dtype_name(kv_dtype))
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE or not 1 <= block_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size and --block-size must be in 1..{MAX_CHUNK_SIZE}")
    ranges = parse_roi(roi) if roi is not None else None  # before the model loads: a typo fails fast
    params = codec_params(codec, level=level, shuffle=shuffle, bins=bins)
    weights = dtype_from_name(model_dtype_name(model_dtype))
    where = resolve_device(device)
    if store is not None:  # an unreachable store fails before the model loads
        open_store(store).close()
    if on_chunk is not None:
        on_chunk(0, 0, 0)  # the model is loading
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=weights, device=where)
    ids = read_tokens(loaded, prompt, prompt_file, tokens_file, chat=chat)
    progress = None if on_chunk is None else (lambda index, end: on_chunk(index, end, len(ids)))
    return capture(loaded, ids, output, chunk_size=chunk_size, codec=codec, params=params, kv_dtype=kv,
                   block_size=block_size, hidden_states=hidden_states, roi=ranges, on_chunk=progress, store=store,
                   segment=segment, namespace=namespace,
                   metadata={"prompt_format": "chat template, user message" if chat else "plain text"}
                   if tokens_file is None else None)


def capture(model: LoadedModel, token_ids: list[int], output: str | Path | None, *, chunk_size: int = 256,
            codec: str = "raw", params: dict[str, Any] | None = None,
            kv_dtype: torch.dtype = torch.bfloat16, block_size: int = 16, shuffle_seed: int | None = 0,
            hidden_states: bool = False, roi: list[tuple[int, int]] | None = None,
            on_chunk: Callable[[int, int], None] | None = None,
            metadata: dict[str, str] | None = None, store: str | None = None,
            segment: bool = False, namespace: str | None = None) -> CaptureResult:
    """Prefill `token_ids` chunk by chunk and write each chunk's KV as soon as it exists.

    The paged buffers live where the model does (`model.device`). On a GPU the
    connector's gather is the fused CUDA kernel; the chunk stays on the GPU for
    a codec that encodes there (CacheGen) and goes to pinned host memory for the
    others.

    Extras (format-spec/container.md): `hidden_states` stores the final hidden
    states [n, hidden] (after the final norm, in the model's dtype: vLLM's
    lookup-buffer value; replay then needs no compute for the first new token);
    `roi` marks token ranges [start, end) in a `roi_mask`.

    `store` (a URL, format-spec/store.md) also puts the whole chunks into the chunk store, as
    encoded, under `namespace` when given; with `output` None the container is built in memory
    for that alone.

    `segment` writes the manifest key `segment` (format-spec/segment.md): the tokens were computed
    alone from position 0 (stored_start 0), so the KV may be placed elsewhere in a new prompt
    (`kvtool.ops.blend`). Store objects do not carry it: a segment is found there by its tokens."""
    if output is None and store is None:
        raise UsageError("give an output path, a store, or both")
    n = len(token_ids)
    mask = roi_mask(n, roi) if roi is not None else None
    device = model.device
    cache = PagedKVCache.for_tokens(model.config, n, block_size=block_size, kv_dtype=kv_dtype,
                                    device=device, shuffle_seed=shuffle_seed)
    seq = cache.new_sequence(n)
    slot_mapping = seq.slot_mapping(n, device=device)  # [n], the whole sequence's slots
    connector = paged_connector(model)
    blob_device, pinned = codecs.get_codec(codec).input_placement(device)
    runner = Runner(model, cache)
    timings = CaptureTimings()
    started = time.perf_counter()
    metadata = {"engine": "kvtool paged runner", "block_size": str(block_size), "device": describe(device),
                "model_dtype": str(model.dtype).removeprefix("torch."), **(metadata or {})}
    hidden: list[torch.Tensor] = []
    extensions = segment_extension(0) if segment else None
    # chunk i is encoded, checksummed and written on a background thread while chunk i+1 is prefilled
    with ContainerWriter(output, model.identity, token_ids, kv_dtype=kv_dtype, chunk_size=chunk_size,
                         metadata=metadata, extensions=extensions) as writer, SavePipeline(max_pending=2) as saving:
        for index, (start, end) in enumerate(writer.chunk_ranges()):
            t0 = time.perf_counter()
            h = runner.prefill(seq, token_ids[start:end], start_pos=start, prefill_chunk=chunk_size,
                               logits="hidden" if hidden_states else "none")  # [T, E] or None
            if h is not None:
                hidden.append(h.cpu())  # the model's own dtype: replay's first token is then exact
            synchronize(device)
            t1 = time.perf_counter()
            memory = connector.allocate(end - start, kv_dtype, blob_device, pin_memory=pinned)
            connector.from_gpu(memory, start, end, kvcaches=cache.kv_caches, slot_mapping=slot_mapping)
            synchronize(device)
            t2 = time.perf_counter()

            def write(kv=memory.tensor, index=index, end=end) -> None:
                began = time.perf_counter()
                writer.write_chunk(kv, codec, params)
                timings.writer_s += time.perf_counter() - began  # on the saving thread only
                if on_chunk is not None:
                    on_chunk(index, end)

            saving.submit(write)
            timings.waiting_s += time.perf_counter() - t2  # the caller blocked: 2 chunks were in flight
            timings.prefill_s += t1 - t0
            timings.connector_s += t2 - t1
        t_finish = time.perf_counter()
        saving.drain()
        if hidden:
            writer.write_extra("hidden_states", torch.cat(hidden))  # [n, E]
        if mask is not None:
            writer.write_extra("roi_mask", mask)
    timings.waiting_s += time.perf_counter() - t_finish
    stored_in = None
    if store is not None:
        with open_store(store) as chunk_store, \
                ContainerReader(output if output is not None else BytesSource(writer.getvalue())) as reader:
            put = ingest(reader, chunk_store, ExtraKeys(namespace=namespace or ""))
            stored_in = {"store": chunk_store.url, "chunks": put.chunks, "stored": put.stored, "present": put.present}
    file_bytes = Path(output).stat().st_size if output is not None else len(writer.getvalue())
    decoded = sum(c.decoded_bytes for c in writer.chunks)
    stored = sum(c.blob.length for c in writer.chunks)
    return CaptureResult(
        output=str(output) if output is not None else None, model=model.name, fingerprint=model.identity.fingerprint(), num_tokens=n,
        num_chunks=len(writer.chunks), chunk_size=chunk_size, codec=codec,
        kv_dtype=str(kv_dtype).removeprefix("torch."), device=describe(device),
        model_dtype=str(model.dtype).removeprefix("torch."), block_size=block_size, extras=sorted(writer.extras),
        file_bytes=file_bytes, decoded_bytes=decoded, stored_bytes=stored,
        seconds=time.perf_counter() - started, prefill_tokens_per_s=n / max(timings.prefill_s, 1e-9),
        timings={**asdict(timings), "overhead_share": timings.overhead_share}, store=stored_in,
        segment=extensions["segment"] if extensions else None)


def roi_mask(num_tokens: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """bool [num_tokens], True inside the given [start, end) ranges."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    for start, end in ranges:
        if end > num_tokens:
            raise UsageError(f"--roi range {start}:{end} ends past the prompt ({num_tokens} token"
                             f"{'s' if num_tokens != 1 else ''})")
        mask[start:end] = True
    return mask


def capture_kv(model_path: str | Path | None, text: str, num_tokens: int,
               kv_dtype: torch.dtype = torch.bfloat16):
    """KV_BLOB `[2, L, T, C]` of the first `num_tokens` tokens of `text` (for benches).

    Returns (kv, token_ids, identity). The text is repeated if it is too short.
    """
    model = load_model(model_path)
    ids = model.tokenizer.encode(text)
    if not ids:
        raise PromptError("the text is empty")
    while len(ids) < num_tokens:
        ids = ids + ids
    ids = ids[:num_tokens]
    cache = PagedKVCache.for_tokens(model.config, num_tokens, kv_dtype=kv_dtype, shuffle_seed=0)
    seq = cache.new_sequence(num_tokens)
    Runner(model, cache).prefill(seq, ids, logits="none")
    connector = paged_connector(model)
    memory = connector.allocate(num_tokens, kv_dtype)
    connector.from_gpu(memory, 0, num_tokens, kvcaches=cache.kv_caches,
                                    slot_mapping=seq.slot_mapping(num_tokens))
    return memory.tensor, ids, model.identity
