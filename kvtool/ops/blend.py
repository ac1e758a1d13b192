"""Blending cached segments (CacheBlend): `kvtool replay --blend`.

A prompt made of separately cached text segments and a final question: each segment's KV comes
from a segment file (format-spec/segment.md) or the chunk store, loaded through `kvtool.load` with a
replay's checks (CRC-32C, decode, every value finite; the model's identity checked here), goes into
a fresh paged cache at its new positions (keys re-encoded), and `kvtool.engine.blend.blend_prefill`
recomputes the `recompute_ratio` share of cached tokens whose KV deviates most, plus the question.
`compare` measures the result against a full prefill of the same tokens and against naive reuse
(ratio 0).

The retriever follows LMCache's special-token retriever, on text: the prompt is split at a
delimiter string (" # # " by default), every piece but the last is a segment, the last is the
question. Each piece is tokenized alone, as it was when it was captured alone (segment.md §5);
the model's input is the pieces' tokens one after another, without the delimiter. A piece's KV
is the given file holding exactly its tokens, else the chunk store's longest run of whole chunks
of its tokens from token 0 (a segment captured alone into the store), the rest of the piece
(the tail after the last whole chunk) computed; a piece found nowhere is uncached text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..devices import describe, synchronize
from ..engine import LoadedModel, Runner
from ..engine.blend import DEFAULT_CHECK_LAYER, BlendResult, Segment, blend_prefill, check_segment
from ..errors import ModelMismatch, PromptError, ToleranceExceeded, UsageError
from ..format import ContainerReader
from ..format.made_by import check_vocabulary
from ..fsutil import read_text_file
from ..identity import ModelIdentity
from ..load import file_tasks, load_blob
from ..engine.model import DEFAULT_PREFILL_CHUNK
from .compare import compare_logits, forced_along, measure
from .engine_io import new_cache
from .engines import KvtoolSequence, greedy, open_engine, recompute
from .inputs import check_text
from .replay import check_context
from .requests import BlendRequest
from .result import Result

DEFAULT_DELIMITER = " # # "  # LMCache's blend_special_str


@dataclass
class SegmentReport:
    """Where one part of the blended prompt came from."""

    source: str  # a file's path, the store's URL, or "text" (uncached)
    tokens: int
    cached_tokens: int  # tokens whose KV was reused (the rest is computed in every layer)
    stored_start: int | None = None  # positions the cached keys were rotated at (segment.md)
    marked_segment: bool = False  # the file carries the `segment` key


@dataclass
class BlendReplayResult(Result):
    """What `blend_replay` did; with `compare`, its agreement with a full prefill and with naive
    reuse (ratio 0) along the full prefill's greedy continuation, and the three TTFTs."""

    model: str
    device: str
    model_dtype: str
    kv_dtype: str
    num_tokens: int
    question_tokens: int
    cached_tokens: int
    segments: list[SegmentReport]
    recompute_ratio: float
    check_layer: int
    prefix_tokens: int  # a first segment cached from 0 is an exact prefix: never recomputed
    recomputed_cached: int  # cached tokens recomputed from the check layer on
    recompute_fraction: float  # of the cached tokens after the prefix
    computed_tokens: int  # run from the check layer on: recomputed_cached + uncached tokens
    load_s: float  # reading and decoding the segments' KV (files, store)
    ttft_blend_s: float  # load + placing + the blended prefill, to the first token's logits
    continue_tokens: int
    continuation_tokens: list[int]  # with compare: the full prefill's greedy continuation (the reference)
    continuation: str
    ttft_full_s: float | None = None
    ttft_naive_s: float | None = None  # load + placing + the prefill at ratio 0
    speedup: float | None = None  # ttft_full_s / ttft_blend_s
    blend: dict[str, Any] | None = None  # compare_logits of the blend vs the full prefill
    naive: dict[str, Any] | None = None  # the same for naive reuse
    blend_continuation_tokens: list[int] | None = None  # the blend's own greedy continuation
    blend_continuation: str | None = None
    agreed_continuation: str | None = None
    thresholds: dict[str, float | None] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


# --- segments from files and the store ------------------------------------------------------


def segment_from_reader(reader: ContainerReader, model: LoadedModel | None = None,
                        allow_other_weights: bool = False) -> Segment:
    """An engine Segment (tokens, KV [2, L, T, C] in the file's dtype, stored_start, identity) of an
    open container. A file without the `segment` key is the KV of its tokens from position 0, which
    is a segment at 0 when it was computed alone (every `kvtool capture` is). With `model`, the file
    is checked against it first (segment.md §4: RoPE, then the model, then the weights)."""
    info = reader.segment
    identity = ModelIdentity.from_dict({k: v for k, v in reader.model.items() if k != "fingerprint"})
    if allow_other_weights:
        identity = replace(identity, weights_digest=None)
    tokens = reader.token_ids().tolist()
    segment = Segment(tokens, None, info.stored_start if info is not None else 0, identity)
    if model is not None:
        check_segment(segment, model, 0, name=str(reader.path))
        if identity.fingerprint() != reader.fingerprint:
            raise ModelMismatch(f"{reader.path}: its recorded model fingerprint does not match the model it "
                                f"describes (forged or damaged)")
        check_vocabulary(tokens, model.config.vocab_size, where=f"{reader.path}: ")
    segment.kv = segment_kv(reader)
    return segment


def segment_kv(reader: ContainerReader) -> torch.Tensor:
    """A segment file's KV_BLOB `[2, L, T, C]`, loaded through the one load path (`kvtool.load`):
    each chunk's CRC-32C, its decode and every value finite checked as a replay checks them; the
    first chunk refused ends the blend (ChecksumMismatch, DecodeError, NonFiniteValues), before
    the model runs."""
    first = reader.chunks[0].shape  # [2, L, T_0, C]: every chunk has its file's layers and channels
    tasks = file_tasks(reader, reader.num_tokens, named=True)
    return load_blob(tasks, (2, first[1], reader.num_tokens, first[3]), reader.kv_dtype)


def segment_from_file(path: str | Path, model: LoadedModel | None = None,
                      allow_other_weights: bool = False) -> Segment:
    """`segment_from_reader` of the file at `path`."""
    with ContainerReader(path) as reader:
        return segment_from_reader(reader, model, allow_other_weights)


def split_prompt(text: str, delimiter: str = DEFAULT_DELIMITER) -> tuple[list[str], str]:
    """(segment texts, question): the pieces of `text` between delimiters; the last is the question.
    Empty pieces (delimiters side by side, or at the start) are dropped."""
    if not delimiter:
        raise UsageError("the blend delimiter is empty")
    pieces = text.split(delimiter)
    if len(pieces) < 2:
        raise UsageError(f"the prompt holds no delimiter {delimiter!r}: nothing to blend")
    return [p for p in pieces[:-1] if p], pieces[-1]


@dataclass
class _Part:
    """One piece of the prompt: its engine segments (a cached run, and an uncached tail after it
    when the store holds only its whole chunks) and where they came from."""

    segments: list[Segment]
    report: SegmentReport


def _from_store(chunk_store, model: LoadedModel, tokens: list[int], chunk_size: int | None, extra_keys) -> _Part:
    """The store's longest cached run of whole chunks of `tokens` from token 0 (loaded through the
    one load path as tensors, each object checked: a segment at 0 of this model and weights),
    then the uncached tail."""
    cache = chunk_store.best_cache(model.identity, tokens, chunk_size, extra_keys)
    hit = cache.get_prefix(tokens)
    if hit.num_tokens == 0:
        return _Part([Segment(tokens)], SegmentReport("text", len(tokens), 0))
    n = hit.num_tokens
    cached = Segment(tokens[:n], hit.kv(), 0, model.identity)  # (the store's key: this model and weights)
    tail = [Segment(tokens[n:])] if n < len(tokens) else []
    return _Part([cached, *tail], SegmentReport(chunk_store.url, len(tokens), n, 0))


def retrieve(model: LoadedModel, pieces: list[str], files: list[str], store: str | None = None,
             chunk_size: int | None = None, allow_other_weights: bool = False,
             namespace: str | None = None) -> list[_Part]:
    """Each piece tokenized alone and its KV found: the given file holding exactly its tokens, else
    the store's whole chunks from its first token (the tail after them computed; under
    `namespace`), else none (uncached text). Every file must match a piece."""
    from ..store.names import ExtraKeys

    keys = ExtraKeys(namespace=namespace or "")
    readers = [ContainerReader(f) for f in files]
    try:
        file_tokens = [r.token_ids().tolist() for r in readers]
        used = [False] * len(readers)
        parts: list[_Part] = []
        chunk_store = None
        if store is not None:
            from ..store import open_store

            chunk_store = open_store(store, create=False)
        try:
            for piece in pieces:
                tokens = model.tokenizer.encode(piece)
                if not tokens:
                    continue
                match = next((i for i, t in enumerate(file_tokens) if t == tokens), None)
                if match is not None:
                    used[match] = True
                    reader = readers[match]
                    seg = segment_from_reader(reader, model, allow_other_weights)
                    parts.append(_Part([seg], SegmentReport(str(reader.path), len(tokens), len(tokens),
                                                            seg.stored_start, reader.segment is not None)))
                elif chunk_store is not None:
                    parts.append(_from_store(chunk_store, model, tokens, chunk_size, keys))
                else:
                    parts.append(_Part([Segment(tokens)], SegmentReport("text", len(tokens), 0)))
        finally:
            if chunk_store is not None:
                chunk_store.close()
        unused = [str(r.path) for r, u in zip(readers, used) if not u]
        if unused:
            raise UsageError(f"--blend {unused[0]}: its tokens are not those of any segment of the prompt "
                             f"(each piece between delimiters is tokenized alone)")
        return parts
    finally:
        for r in readers:
            r.close()


def _file_parts(model: LoadedModel, files: list[str], allow_other_weights: bool) -> list[_Part]:
    parts = []
    for f in files:
        with ContainerReader(f) as reader:
            seg = segment_from_reader(reader, model, allow_other_weights)
            parts.append(_Part([seg], SegmentReport(str(reader.path), len(seg.tokens), len(seg.tokens),
                                                    seg.stored_start, reader.segment is not None)))
    return parts


def blend_replay(files: list[str] | BlendRequest | None = None, model: str | Path | LoadedModel | None = None, *,
                 on_stage: Callable[[str], None] | None = None, **options: Any) -> BlendReplayResult:
    """`kvtool replay --blend` as a function: a `BlendRequest`, or its fields as keywords (checked
    there), run by `run_blend`.

    Without `delimiter`: the prompt is the `files`' segments, in order, then the question
    (`prompt` / `prompt_file`, tokenized alone). With `delimiter`: the prompt text is split there
    (`split_prompt`) and each piece's KV found in `files` or the `store` (`retrieve`). Then the
    blended prefill, a greedy continuation of `continue_tokens`, and with `compare` the full
    prefill and naive reuse along the full prefill's greedy continuation. `min_top1` / `max_kl`
    (each implies `compare`) hold the blend to a threshold (ToleranceExceeded, with the result)."""
    request = files if isinstance(files, BlendRequest) else BlendRequest(files=files, model=model, **options)
    return run_blend(request, on_stage)


# --- the steps of a blended replay ----------------------------------------------------------


def run_blend(request: BlendRequest, on_stage: Callable[[str], None] | None = None) -> BlendReplayResult:
    """A checked blend: its inputs found (`open_inputs`), the blended prefill (`blend_into_cache`),
    the continuation (greedy, or with `compare` measured against the full prefill and naive reuse:
    `measure_blend`), the result held to the request's thresholds."""
    stage = on_stage or _no_stage
    inputs = open_inputs(request, stage)
    stage(f"blending {inputs.num_tokens} tokens")
    blended = blend_into_cache(inputs, request, request.ratio, seed=1)
    if request.compares:
        generated, measured = measure_blend(inputs, request, blended, stage)
    else:
        generated, measured = greedy(blended.runner, blended.seq, blended.first, request.continue_tokens), {}
    return _check_thresholds(blend_result(inputs, request, blended, generated, measured),
                             request.min_top1, request.max_kl)


def _no_stage(_text: str) -> None:
    """`on_stage` when nobody shows the stages."""


@dataclass(frozen=True)
class BlendInputs:
    """A blend's inputs once found: the model, the layer where tokens to recompute are chosen,
    the prompt's parts (cached runs and uncached text) and question, and what reading the
    cached KV took."""

    model: LoadedModel
    check_layer: int
    parts: list[_Part]
    question: list[int]
    load_s: float

    @property
    def segments(self) -> list[Segment]:
        return [s for p in self.parts for s in p.segments]

    @property
    def tokens(self) -> list[int]:
        """The model's input: the segments' tokens one after another, then the question's."""
        return [t for s in self.segments for t in s.tokens] + self.question

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments) + len(self.question)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cached KV's dtype (bf16 when nothing is cached)."""
        return next((s.kv.dtype for s in self.segments if s.kv is not None), torch.bfloat16)


def open_inputs(request: BlendRequest, stage: Callable[[str], None]) -> BlendInputs:
    """The prompt split into pieces and question, the model loaded (the check layer and the
    question checked against it), and each piece's KV read (timed: part of the TTFT)."""
    pieces, question_text = prompt_pieces(request)
    if request.store is not None:  # an unreachable store fails before the model loads
        from ..store import open_store

        open_store(request.store, create=False).close()
    stage("loading the model")
    model = open_engine(request).model  # (kvtool's engine: the blend runs in its paged runner)
    layer = _check_layer(request, model)
    question = model.tokenizer.encode(question_text)
    check_vocabulary(question, model.config.vocab_size)
    _warm_up(model)
    stage("reading the segments' KV")
    synchronize(model.device)
    t0 = time.perf_counter()
    parts = retrieve(model, pieces, list(request.files), request.store, request.chunk_size,
                     request.allow_other_weights, request.namespace) if request.delimiter is not None \
        else _file_parts(model, list(request.files), request.allow_other_weights)
    load_s = time.perf_counter() - t0
    if not parts:
        raise PromptError("the prompt holds no segment text")
    inputs = BlendInputs(model, layer, parts, question, load_s)
    check_context(model, inputs.num_tokens, request.continue_tokens)
    return inputs


def prompt_pieces(request: BlendRequest) -> tuple[list[str], str]:
    """(segment texts, question) of the request's prompt: split at the delimiter, or with none,
    no pieces (the segments are the files) and the whole prompt the question."""
    text = check_text(read_text_file(request.prompt_file) if request.prompt_file is not None else request.prompt,
                      "--prompt")
    if request.delimiter is None:
        return [], text
    return split_prompt(text, request.delimiter)


def _check_layer(request: BlendRequest, model: LoadedModel) -> int:
    layer = DEFAULT_CHECK_LAYER if request.check_layer is None else request.check_layer
    if not 0 <= layer < model.config.num_layers:
        raise UsageError(f"--check-layer {layer}: the model's layers are 0..{model.config.num_layers - 1}")
    return layer


@dataclass(frozen=True)
class BlendRun:
    """One blended prefill into a fresh paged cache: what the engine did, the runner and sequence
    to continue from, and how long it took."""

    result: BlendResult
    runner: Runner
    seq: Any
    seconds: float

    @property
    def first(self) -> torch.Tensor:
        """[1, V], the first new token's logits."""
        return self.result.logits[None]

    @property
    def sequence(self) -> KvtoolSequence:
        """The blended sequence as a measure runs it."""
        return KvtoolSequence(self.runner, self.seq)


def blend_into_cache(inputs: BlendInputs, request: BlendRequest, ratio: float, seed: int) -> BlendRun:
    """A fresh shuffled paged cache with room for the prompt and the continuation, and the blended
    prefill into it at recompute `ratio`, timed."""
    model = inputs.model
    cache, seq = new_cache(model, inputs.num_tokens + request.continue_tokens, inputs.kv_dtype, request.block_size,
                           seed)  # slots reserved, no tokens yet
    runner = Runner(model, cache)
    synchronize(model.device)
    t0 = time.perf_counter()
    result = blend_prefill(runner, seq, inputs.segments, inputs.question, recompute_ratio=ratio,
                           check_layer=inputs.check_layer)
    synchronize(model.device)
    return BlendRun(result, runner, seq, time.perf_counter() - t0)


def measure_blend(inputs: BlendInputs, request: BlendRequest, blended: BlendRun,
                  stage: Callable[[str], None]) -> tuple[list[int], dict[str, Any]]:
    """The full prefill (the reference) and naive reuse (ratio 0); the blend and naive reuse each
    teacher-forced along the reference's greedy continuation and compared with it, then the
    blend's own greedy continuation. Returns (the reference continuation, the measurements:
    `BlendReplayResult` fields)."""
    model, n, continue_tokens = inputs.model, inputs.num_tokens, request.continue_tokens
    stage(f"recomputing {n} tokens and {continue_tokens} more (the reference)")
    ref_logits, generated, ttft_full = recompute(model, inputs.tokens, continue_tokens, inputs.kv_dtype,
                                                 request.block_size, prefill_chunk=max(n, 1))  # [N, V]
    blend_cmp, own = measure(ref_logits, generated, blended.sequence, inputs.tokens,
                             blended.first, DEFAULT_PREFILL_CHUNK)
    stage("naive reuse (recompute ratio 0)")
    naive = blend_into_cache(inputs, request, 0.0, seed=2)
    naive_logits = forced_along(naive.sequence, inputs.tokens, naive.first, generated,
                                DEFAULT_PREFILL_CHUNK)  # [N, V]
    naive_cmp = compare_logits(ref_logits, naive_logits, generated)
    same = blend_cmp["greedy_identical_tokens"]
    return generated, {"ttft_full_s": ttft_full, "ttft_naive_s": inputs.load_s + naive.seconds,
                       "speedup": ttft_full / max(inputs.load_s + blended.seconds, 1e-9), "blend": blend_cmp,
                       "naive": naive_cmp, "blend_continuation_tokens": own,
                       "blend_continuation": model.tokenizer.decode(own),
                       "agreed_continuation": model.tokenizer.decode(generated[:same])}


def blend_result(inputs: BlendInputs, request: BlendRequest, blended: BlendRun, generated: list[int],
                 measured: dict[str, Any]) -> BlendReplayResult:
    model, result = inputs.model, blended.result
    return BlendReplayResult(
        model=model.name, device=describe(model.device), model_dtype=str(model.dtype).removeprefix("torch."),
        kv_dtype=str(inputs.kv_dtype).removeprefix("torch."), num_tokens=inputs.num_tokens,
        question_tokens=len(inputs.question), cached_tokens=int(result.cached.sum()),
        segments=[p.report for p in inputs.parts], recompute_ratio=request.ratio, check_layer=inputs.check_layer,
        prefix_tokens=result.prefix, recomputed_cached=result.recomputed_cached,
        recompute_fraction=result.recompute_fraction, computed_tokens=int(result.recomputed.numel()),
        load_s=inputs.load_s, ttft_blend_s=inputs.load_s + blended.seconds, continue_tokens=len(generated),
        continuation_tokens=generated, continuation=model.tokenizer.decode(generated), **measured)


def _warm_up(model: LoadedModel) -> None:
    """Pay the one-time costs of the first forward pass (thread pools, kernel choice, lazy modules)
    before anything is timed: the blend, timed first, would otherwise carry them."""
    cache, seq = new_cache(model, 4, torch.bfloat16, 16, seed=0)
    Runner(model, cache).prefill(seq, [0, 0, 0, 0], logits="last")
    synchronize(model.device)


def _check_thresholds(result: BlendReplayResult, min_top1: float | None,
                      max_kl: float | None) -> BlendReplayResult:
    result.thresholds = {"min_top1": min_top1, "max_kl": max_kl}
    if min_top1 is not None and not result.blend["top1_agreement"] >= min_top1:
        result.failures.append(f"top-1 agreement {result.blend['top1_agreement']:.3f} < {min_top1}")
    if max_kl is not None and not result.blend["kl_mean"] <= max_kl:
        result.failures.append(f"mean KL {result.blend['kl_mean']:.3g} > {max_kl}")
    if result.failures:
        raise ToleranceExceeded(f"blend below threshold: {'; '.join(result.failures)}", report=result)
    return result
