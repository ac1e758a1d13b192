"""Capture: run a model through a paged KV buffer and stream its KV into a file.

The KV leaves the engine the way it leaves a serving engine: chunk by chunk,
gathered from the paged buffer by `PagedMemConnectorV2.from_gpu` with the
sequence's full slot mapping. Prefill runs one chunk ahead of the writer, so a
chunk is on disk as soon as the model has produced it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Union

import torch

from .. import codecs
from ..devices import describe, synchronize
from ..engine import LoadedModel, PagedKVCache, Runner, load_model
from ..engine.protocol import CaptureSteps, Engine
from ..errors import PromptError, UsageError
from ..format import ContainerReader, ContainerWriter
from ..format.made_by import check_vocabulary
from ..format.reader import BytesSource
from ..store import open_store
from ..store.containers import ingest
from ..format.segment import segment_extension
from ..fsutil import read_text_file
from ..load import SavePipeline
from . import engines
from .engine_io import paged_connector
from .engines import as_engine, open_engine
from .inputs import check_text, check_token_source, read_token_file
from .requests import CaptureRequest, PromptCaptureRequest, prompt_metadata
from .moved import moved_names
from .result import Result

#: what a capture or a replay runs: a model of either engine (kvtool's paged runner's `LoadedModel`;
#: Any: a transformers model or `kvtool.integrations.hf`'s `HFModel`), or one already in its engine
#: (`kvtool.ops.engines.as_engine`)
AnyModel = Union[LoadedModel, Engine, Any]


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
    engine: str = "kvtool"  # "kvtool" (its paged runner) or "hf" (transformers; its cache one block of every token)


# --- tokens ---------------------------------------------------------------------------------


def read_tokens(model: AnyModel, prompt: str | None = None, prompt_file: Path | None = None,
                tokens_file: Path | None = None, chat: bool = False, generation_prompt: bool = True) -> list[int]:
    """Token ids from exactly one of: a prompt, a prompt file, or a token-id file. With `chat`,
    the prompt is a user message in the model's chat template (as transformers applies it; with
    `generation_prompt`, the assistant's turn opened after it)."""
    check_token_source(prompt, prompt_file, tokens_file, chat)
    return _source_tokens(model, prompt, prompt_file, tokens_file, chat, generation_prompt)


def _source_tokens(model: AnyModel, prompt: str | None, prompt_file: Path | None, tokens_file: Path | None,
                   chat: bool, generation_prompt: bool = True) -> list[int]:
    """The token ids of a checked source (`check_token_source`), checked against the model: inside
    its vocabulary, not empty, within its context."""
    if tokens_file is not None:
        ids = read_token_file(tokens_file)
        check_vocabulary(ids, model.config.vocab_size)
    else:
        text = check_text(prompt if prompt is not None else read_text_file(prompt_file), "--prompt")
        ids = encode_prompt(model, text, chat, generation_prompt)
    if not ids:
        raise PromptError("the prompt is empty")
    if len(ids) > model.max_position_embeddings:
        raise PromptError(f"the prompt has {len(ids)} tokens, more than the model's context of "
                          f"{model.max_position_embeddings}")
    return ids


def encode_prompt(model: AnyModel, text: str, chat: bool, generation_prompt: bool = True) -> list[int]:
    """Token ids of `text`: as plain text (with the special tokens the engine's convention adds:
    `adds_special_tokens`), or (chat) as a user message in the model's chat template, which
    writes its special tokens itself (as transformers' `apply_chat_template` encodes it), the
    assistant's turn opened after it with `generation_prompt`."""
    if chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                   add_generation_prompt=generation_prompt)
        return model.tokenizer.encode(text, add_special_tokens=False)
    return model.tokenizer.encode(text, add_special_tokens=adds_special_tokens(model))


def adds_special_tokens(model: AnyModel) -> bool:
    """Whether plain text gets the tokenizer's special tokens (a BOS, for many models): with
    transformers, as `tokenizer(text)` does; kvtool's engine takes the text as it is."""
    return as_engine(model).adds_special_tokens


def tokenizer_metadata(model: AnyModel, chat: bool) -> dict[str, str]:
    """What the file records of the model's part in making the tokens: for a chat, the SHA-256 of
    the chat template's text; for plain text, whether special tokens were added."""
    if chat:
        template = model.tokenizer.chat_template or ""
        return {"chat_template_sha256": "sha256:" + hashlib.sha256(template.encode("utf-8")).hexdigest()}
    return {"add_special_tokens": "true" if adds_special_tokens(model) else "false"}


# --- the operations -------------------------------------------------------------------------


def capture_prompt(output: str | Path | PromptCaptureRequest | None = None, *,
                   on_chunk: Callable[[int, int, int], None] | None = None, **options: Any) -> CaptureResult:
    """`kvtool capture` as a function: a `PromptCaptureRequest`, or its fields and its capture's
    (`CaptureRequest`'s) as keywords, as the command line gives them, every one checked before the
    model loads; `on_chunk(index, tokens_done, tokens_total)` reports progress. `store` (a URL)
    also puts the whole chunks into the chunk store; without `output`, only there. `segment` marks
    the file a position-independent segment (format-spec/segment.md). `engine` "hf" runs the model
    with transformers (any decoder-only model with a plain KV cache). `quality` and `calibration`
    (a digest) are pca's: without `calibration`, the one `kvtool calibrate` registered for the
    model. Run by `run_prompt_capture`."""
    request = output if isinstance(output, PromptCaptureRequest) else PromptCaptureRequest.of(output=output, **options)
    return run_prompt_capture(request, on_chunk)


def run_prompt_capture(request: PromptCaptureRequest,
                       on_chunk: Callable[[int, int, int], None] | None = None) -> CaptureResult:
    """A checked `kvtool capture`: the store reached, the model loaded, the prompt's tokens read,
    then the capture (`run_capture`)."""
    if request.capture.store is not None:  # an unreachable store fails before the model loads
        open_store(request.capture.store).close()
    if on_chunk is not None:
        on_chunk(0, 0, 0)  # the model is loading
    model = open_engine(request)
    ids = _source_tokens(model, request.prompt, request.prompt_file, request.tokens_file, request.chat,
                         request.generation_prompt)
    what = request.capture
    if request.tokens_file is None:  # how the text became these tokens, the model's part included
        what = replace(what, metadata={**(what.metadata or {}), **prompt_metadata(request.chat, None,
                                                                                  request.generation_prompt),
                                       **tokenizer_metadata(model, request.chat)})
    progress = None if on_chunk is None else (lambda index, end: on_chunk(index, end, len(ids)))
    return run_capture(model, ids, what, progress)


def capture(model: AnyModel, token_ids: list[int], output: str | Path | CaptureRequest | None = None, *,
            on_chunk: Callable[[int, int], None] | None = None, **options: Any) -> CaptureResult:
    """Prefill `token_ids` chunk by chunk and write each chunk's KV as soon as it exists.

    `model` is kvtool's engine's (`kvtool.load_model`) or a transformers causal LM (whose cache,
    one block of every token, the same connector gathers from; `block_size` does not apply).
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
    (`kvtool.ops.blend`). Store objects do not carry it: a segment is found there by its tokens.

    A `CaptureRequest`, or its fields as keywords (`params`: the codec's parameters as they are,
    or its options `level`, `shuffle`, `bins`, `quality`, `calibration`, `bitstream`; not both),
    run by `run_capture`."""
    request = output if isinstance(output, CaptureRequest) else CaptureRequest(output, **options)
    return run_capture(model, token_ids, request, on_chunk)


# --- the steps of a capture -----------------------------------------------------------------


def run_capture(model: AnyModel, token_ids: list[int], request: CaptureRequest,
                on_chunk: Callable[[int, int], None] | None = None) -> CaptureResult:
    """A checked capture of `token_ids`, in whichever engine runs the model: the roi mask (its
    ranges checked against the prompt), a cache for the tokens (`capture_steps`: kvtool's shuffled
    paged cache, or transformers' own), the chunks prefilled and written as they come
    (`write_chunks`), the whole chunks put into the store (`put_in_store`), the result.
    `on_chunk(index, tokens_done)` after each chunk is written."""
    engine = as_engine(model)
    params = request.codec_params_for(engine.identity.fingerprint())  # (pca: the model's calibration)
    if params is not request.params:  # the codec's options, now its parameters, are held there alone
        request = replace(request, params=params, level=None, shuffle=None, bins=None, quality=None,
                          calibration=None, bitstream=None)
    mask = roi_mask(len(token_ids), request.roi) if request.roi is not None else None
    steps = capture_steps(engine, len(token_ids), request)
    started = time.perf_counter()
    writer, timings = write_chunks(engine, token_ids, request, steps, mask, on_chunk)
    stored_in = put_in_store(request, writer) if request.store is not None else None
    return capture_result(engine, token_ids, request, writer, timings, started, stored_in)


def capture_steps(model: AnyModel, num_tokens: int, request: CaptureRequest) -> CaptureSteps:
    """The engine's cache for `num_tokens` and how each chunk's KV leaves it: a KV_BLOB placed for
    the request's codec (where it encodes: a GPU for CacheGen, pinned host memory for the others
    of a GPU model)."""
    engine = as_engine(model)
    blob_device, pinned = codecs.get_codec(request.codec).input_placement(engine.device)
    return engine.capture_steps(num_tokens, kv_dtype=request.torch_kv_dtype, block_size=request.block_size,
                                shuffle_seed=request.shuffle_seed, prefill_chunk=request.chunk_size,
                                blob_device=blob_device, pinned=pinned)


def write_chunks(model: AnyModel, token_ids: list[int], request: CaptureRequest, steps: CaptureSteps,
                 mask: torch.Tensor | None, on_chunk: Callable[[int, int], None] | None
                 ) -> tuple[ContainerWriter, CaptureTimings]:
    """The container written chunk by chunk: each chunk prefilled and gathered
    (`prefill_and_gather`), then encoded, checksummed and written on a background thread while the next chunk is
    prefilled; then the extras. Returns the finished writer (its chunks, extras and, built in
    memory, its bytes) and the timings."""
    timings = CaptureTimings()
    hidden: list[torch.Tensor] = []  # [T, E] per chunk, with hidden_states
    extensions = segment_extension(0) if request.segment else None
    with ContainerWriter(request.output, model.identity, token_ids, kv_dtype=request.kv_dtype,
                         chunk_size=request.chunk_size, metadata=run_metadata(model, request),
                         extensions=extensions) as writer, SavePipeline(max_pending=2) as saving:
        for index, (start, end) in enumerate(writer.chunk_ranges()):
            kv = prefill_and_gather(model, token_ids, request, steps, start, end, hidden, timings)
            submitted = time.perf_counter()
            saving.submit(_chunk_job(writer, request, kv, index, end, timings, on_chunk))
            timings.waiting_s += time.perf_counter() - submitted  # the caller blocked: 2 chunks were in flight
        finishing = time.perf_counter()
        saving.drain()
        if hidden:
            writer.write_extra("hidden_states", torch.cat(hidden))  # [n, E]
        if mask is not None:
            writer.write_extra("roi_mask", mask)
        if request.embed_calibration:
            writer.embed_pca_calibrations()
    timings.waiting_s += time.perf_counter() - finishing
    return writer, timings


def run_metadata(model: AnyModel, request: CaptureRequest) -> dict[str, str]:
    """What the file records of the run that computed its KV: the engine (kvtool's: its block;
    transformers': its version, attention implementation and the config's digest), device, dtype,
    and the request's."""
    engine = as_engine(model)
    return {**engine.run_metadata(request.block_size), "device": describe(engine.device),
            "model_dtype": str(engine.dtype).removeprefix("torch."), **(request.metadata or {})}


def prefill_and_gather(model: AnyModel, token_ids: list[int], request: CaptureRequest, steps: CaptureSteps,
                       start: int, end: int, hidden: list[torch.Tensor], timings: CaptureTimings) -> torch.Tensor:
    """Tokens [start, end) prefilled into the cache (their final hidden states appended to
    `hidden` with `hidden_states`), then their KV gathered out of it: KV_BLOB [2, L, T, C]."""
    t0 = time.perf_counter()
    h = steps.prefill(token_ids, start, end, request.hidden_states)  # [T, E] or None
    if h is not None:
        hidden.append(h.cpu())  # the model's own dtype: replay's first token is then exact
    synchronize(model.device)
    t1 = time.perf_counter()
    kv = steps.gather(start, end)
    synchronize(model.device)
    timings.prefill_s += t1 - t0
    timings.connector_s += time.perf_counter() - t1
    return kv


def _chunk_job(writer: ContainerWriter, request: CaptureRequest, kv: torch.Tensor, index: int, end: int,
               timings: CaptureTimings, on_chunk: Callable[[int, int], None] | None) -> Callable[[], None]:
    """The saving thread's job for one chunk: encode, checksum and write it, then report it."""
    def write() -> None:
        began = time.perf_counter()
        writer.write_chunk(kv, request.codec, request.params)
        timings.writer_s += time.perf_counter() - began  # on the saving thread only
        if on_chunk is not None:
            on_chunk(index, end)
    return write


def put_in_store(request: CaptureRequest, writer: ContainerWriter) -> dict[str, Any]:
    """The capture's whole chunks put into the chunk store as encoded, read back from the file
    (or the container built in memory). Returns the result's `store` entry."""
    source = request.output if request.output is not None else BytesSource(writer.getvalue())
    with open_store(request.store) as chunk_store, ContainerReader(source) as reader:
        put = ingest(reader, chunk_store, request.extra_keys, block_size=request.block_size)
        return {"store": chunk_store.url, "chunks": put.chunks, "stored": put.stored, "present": put.present}


def capture_result(model: AnyModel, token_ids: list[int], request: CaptureRequest, writer: ContainerWriter,
                   timings: CaptureTimings, started: float, stored_in: dict[str, Any] | None) -> CaptureResult:
    engine, n, output = as_engine(model), len(token_ids), request.output
    return CaptureResult(
        output=str(output) if output is not None else None, model=engine.name,
        fingerprint=engine.identity.fingerprint(), num_tokens=n, num_chunks=len(writer.chunks),
        chunk_size=request.chunk_size, codec=request.codec, kv_dtype=request.kv_dtype,
        device=describe(engine.device), model_dtype=str(engine.dtype).removeprefix("torch."),
        block_size=engine.capture_block_size(request.block_size, n), extras=sorted(writer.extras),
        file_bytes=Path(output).stat().st_size if output is not None else len(writer.getvalue()),
        decoded_bytes=sum(c.decoded_bytes for c in writer.chunks),
        stored_bytes=sum(c.blob.length for c in writer.chunks),
        seconds=time.perf_counter() - started, prefill_tokens_per_s=n / max(timings.prefill_s, 1e-9),
        timings={**asdict(timings), "overhead_share": timings.overhead_share}, store=stored_in,
        segment=segment_extension(0)["segment"] if request.segment else None,
        engine=engine.kind)


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


# Names this module had before the engines were one interface: each answers with what to use.
__getattr__ = moved_names(__name__, {
    "PagedCapture": ("kvtool.ops.engines.PagedCapture", lambda: engines.PagedCapture),
    "paged_capture": ("capture_steps (any engine)", lambda: capture_steps),
    "hf_capture": ("capture_steps (any engine)", lambda: capture_steps),
    "engine_model": ("kvtool.ops.engines.open_engine", lambda: open_engine),
})
