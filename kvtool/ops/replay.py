"""Replay: load a KV file (or the store's prefix) into a fresh cache and continue from it.

One path for either engine (`kvtool.engine.protocol.Engine`): the file's chunks are loaded
through `kvtool.load.load` into a fresh sequence of the engine's cache (kvtool's runner: a
paged cache with a shuffled, non-contiguous block assignment, through the paged connector's
destination and the sequence's slot mapping; transformers: its contiguous cache as one block,
holding at most all but the prompt's last token). The model then computes only what the file
does not hold. `compare` measures the cached run against a full recompute of the same tokens
(`kvtool.ops.compare.measure`, written once for both engines):

- greedy: the recompute's greedy continuation is the reference; the cached run
  is teacher-forced along it, so "greedy tokens identical up to position i" is
  the first position whose top-1 differs (identical to running greedy decoding
  on the cache, up to that point);
- top-1 agreement, KL(reference || cached) per position, and the change in the
  negative log-likelihood of the reference tokens;
- time to first token: load + decode + the uncached remainder vs a full prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import codecs
from ..devices import describe, synchronize
from ..connectors import ConnectorTarget
from ..engine import LoadedModel
from ..engine.protocol import CachedSequence, Engine, Reference
from ..errors import DataError, NonFiniteValues, PromptError, ShapeMismatch, ToleranceExceeded
from ..format import ContainerReader
from ..format.hashing import prefix_hashes
from ..format.made_by import check_made_by, check_vocabulary
from ..fsutil import read_text_file
from ..load import file_tasks, load
from ..notices import notice
from . import engines
from .compare import measure
from .engines import as_engine, open_engine
from .inputs import check_text, continuation
from .moved import moved_names
from .requests import ReplayRequest
from .result import Result

if TYPE_CHECKING:
    from .capture import AnyModel


@dataclass
class ReplayResult(Result):
    """What `replay` measured. With `compare`: the recompute's TTFT and the agreement of the
    cached run with it along the recompute's greedy continuation."""

    file: str
    model: str
    num_tokens: int
    reused_tokens: int
    computed_tokens: int
    chunks_loaded: int
    codecs: list[str]
    device: str
    model_dtype: str
    first_token_from: str  # "hidden_states" (nothing recomputed) or "prefill"
    weights: str  # "same weights", "not recorded in the file", or "other weights (allowed ...)"
    load_s: float
    ttft_cached_s: float
    continue_tokens: int
    continuation_tokens: list[int]  # with compare: the recompute's greedy continuation (the reference)
    continuation: str
    # with compare: the recompute's time to first token, and how the cached run agrees with it
    ttft_recompute_s: float | None = None
    speedup: float | None = None
    top1_agreement: float | None = None
    greedy_identical_tokens: int | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    nll_reference: float | None = None
    nll_cached: float | None = None
    delta_nll: float | None = None
    max_abs_logit_diff: float | None = None
    # with compare: the cached run's own greedy continuation; it equals the recompute's up to
    # `greedy_identical_tokens`, then goes its own way
    cached_continuation_tokens: list[int] | None = None
    cached_continuation: str | None = None
    agreed_continuation: str | None = None  # the text both produce before they diverge
    thresholds: dict[str, float | None] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notice: str | None = None
    engine: str = "kvtool"  # "kvtool" (its paged runner) or "hf" (transformers: a cache of all but the last token)

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class ReusePlan:
    tokens: list[int]  # the whole sequence to run (file prefix + anything new)
    reused: int  # tokens [0, reused) come from the file
    chunks: int  # how many of the file's chunks are (partly) loaded
    from_hidden: bool = False  # every token is reused; the first new token's logits come from the file's hidden states


def check_model(reader: ContainerReader, model: "AnyModel", allow_other_weights: bool = False) -> str:
    """The file was made by this model (`check_made_by`, the check every engine runs on its
    identity). Returns what was found of the weights, for the report."""
    return check_made_by(reader, model.identity, allow_other_weights=allow_other_weights)


def plan_reuse(reader: ContainerReader, new_tokens: list[int] | None = None,
               suffix_tokens: list[int] | None = None, use_hidden_states: bool = True) -> ReusePlan:
    """Which leading tokens of the run can come from the file.

    With `suffix_tokens`, the run is the file's own tokens plus the suffix, and
    every cached token is reused. With `new_tokens` (a new prompt), the longest
    run of whole chunks whose prefix hashes match is reused. At least one token
    is computed, since its logits start the continuation, unless the file stores
    the final hidden states and every token is reused: the last token's hidden
    state then gives those logits.
    """
    file_tokens = reader.token_ids().tolist()
    size = reader.manifest.chunk_size
    if new_tokens is None:
        tokens = file_tokens + list(suffix_tokens or [])
        reused = len(file_tokens)
    else:
        tokens = list(new_tokens)
        if not tokens:
            raise PromptError("the new prompt is empty")
        reused = 0
        for chunk, want in zip(reader.chunks, prefix_hashes(tokens, size)):
            if chunk.end - chunk.start != size or chunk.prefix_hash != want:
                break
            reused = chunk.end
        if reused == (len(reader.chunks) - 1) * size and tokens[:len(file_tokens)] == file_tokens:
            reused = len(file_tokens)  # the short last chunk matches too
    if use_hidden_states and reused == len(tokens) and "hidden_states" in reader.manifest.extras:
        return ReusePlan(tokens=tokens, reused=reused, chunks=-(-reused // size), from_hidden=True)
    reused = min(reused, len(tokens) - 1)
    return ReusePlan(tokens=tokens, reused=reused, chunks=-(-reused // size))


@dataclass
class Prefix:
    """Where a replay's reused KV comes from (a file's chunks, or the store's objects), and the one
    call that loads it into the paged cache through `kvtool.load.load`."""

    source: str  # the file's path or the store's URL, for the report
    kv_dtype: torch.dtype
    chunk_size: int
    codecs: list[str]
    weights: str  # what is known of the weights that computed it, for the report
    load: Callable[[ConnectorTarget, int], int]  # (destination, tokens wanted) -> tokens loaded from 0
    reader: ContainerReader | None = None  # a file's (its hidden states, its codecs to warm up)


def file_prefix(reader: ContainerReader, model: "AnyModel", allow_other_weights: bool = False) -> Prefix:
    """A container file's chunks as a replay's prefix, after `check_model`."""
    weights = check_model(reader, model, allow_other_weights)

    def load_file(target: ConnectorTarget, num_tokens: int) -> int:
        outcome = load(file_tasks(reader, num_tokens), target)
        if outcome.error is not None:  # a file's damage is the replay's failure, named
            raise outcome.error
        return num_tokens

    return Prefix(source=str(reader.path), kv_dtype=reader.kv_dtype, chunk_size=reader.manifest.chunk_size,
                  codecs=sorted({c.codec for c in reader.chunks}), weights=weights, load=load_file, reader=reader)


#: The paged cache's block (tokens) that `replay --store` runs with (run_plan's default): the
#: granularity its prefix is matched to in the store.
ENGINE_BLOCK = 16


def store_prefix(cache, tokens: list[int], kv_dtype: torch.dtype) -> Prefix:
    """The store's whole chunks of `tokens`, then its longest stored block prefix (a `ModelCache`: this model, its weights, the request's
    extra keys) as a replay's prefix: loaded straight from the objects into the paged cache, each
    checked (a refused one ends the prefix: the rest is computed)."""
    codecs_seen: list[str] = []

    def load_objects(target: ConnectorTarget, num_tokens: int) -> int:
        hit = cache.load_prefix(tokens, target, max_tokens=num_tokens)
        codecs_seen.extend(sorted(set(hit.codecs)))
        return hit.num_tokens

    return Prefix(source=cache.store.url, kv_dtype=kv_dtype, chunk_size=cache.chunk_size, codecs=codecs_seen,
                  weights="same weights (the store's key)", load=load_objects)


def replay(path: str | Path | ReplayRequest | None = None, model: str | Path | LoadedModel | None = None, *,
           on_stage: Callable[[str], None] | None = None, **options: Any) -> ReplayResult:
    """Load a KV file into a fresh paged buffer and continue from it (`kvtool replay`): a
    `ReplayRequest`, or its fields as keywords (checked there), run by `run_replay`.

    `suffix` continues the file's own tokens; `prompt` reuses the file's chunks that a new
    prompt shares. `min_top1` / `max_kl` (each implies `compare`) raise ToleranceExceeded,
    carrying the result, when the cached run falls outside them. `on_stage(text)` says what
    it is doing (a progress display).

    With `store` (a URL) instead of `path`, the longest cached prefix of the prompt comes from
    the chunk store (format-spec/store.md) at `chunk_size` (None: the stored size that covers
    the most), and the rest is computed; `namespace`: only chunks stored under it.

    `engine` "hf" replays with transformers (`model`: a folder, a Hub id in the local cache or a
    transformers model): the prefix loads into a transformers cache and `generate` continues."""
    request = path if isinstance(path, ReplayRequest) else ReplayRequest(path=path, model=model, **options)
    return run_replay(request, on_stage)


# --- the steps of a replay -----------------------------------------------------------------------


def run_replay(request: ReplayRequest, on_stage: Callable[[str], None] | None = None) -> ReplayResult:
    """A checked replay: its prefix from the file or the store, run (`run_plan`), then held to
    the request's thresholds."""
    stage = on_stage or _no_stage
    result = replay_from_store(request, stage) if request.store is not None else replay_from_file(request, stage)
    return _check_thresholds(result, request.min_top1, request.max_kl)


def _no_stage(_text: str) -> None:
    """`on_stage` when nobody shows the stages."""


def replay_from_file(request: ReplayRequest, stage: Callable[[str], None]) -> ReplayResult:
    """`replay FILE`: the file checked against the model (`file_prefix`), the reuse of its chunks
    planned for the suffix or the new prompt (`plan_reuse`), then run."""
    with ContainerReader(request.path) as reader:
        engine = _load_model(request, stage)
        prefix = file_prefix(reader, engine, request.allow_other_weights)  # the file was made by this model
        # (transformers' convention computes the prompt's last token: its stored hidden state is not used)
        plan = plan_reuse(reader, new_tokens=_new_prompt_tokens(request, engine),
                          suffix_tokens=_suffix_tokens(request, engine),
                          use_hidden_states=request.use_hidden_states and engine.starts_from_hidden_states)
        return run_plan(prefix, engine, plan, request.continue_tokens, request.compares, stage)


def replay_from_store(request: ReplayRequest, stage: Callable[[str], None]) -> ReplayResult:
    """`replay --store URL --prompt-file F`: the prompt's longest cached prefix loaded from the
    store's objects straight into the paged cache (`store_prefix`), the rest computed."""
    from ..store import open_store

    with open_store(request.store, create=False) as chunk_store:
        model = _load_model(request, stage)
        tokens = _new_prompt_tokens(request, model)
        if not tokens:
            raise PromptError("the prompt is empty")
        check_vocabulary(tokens, model.config.vocab_size)
        # prefixes match to the engine's block (store.md §7): whole chunks, then block-aligned tokens past them
        cache = chunk_store.best_cache(model.identity, tokens, request.chunk_size, request.extra_keys,
                                       block_size=ENGINE_BLOCK)
        last = (len(tokens) - 1) // cache.block_size * cache.block_size  # at least one token is computed
        stored = min(cache.lookup(tokens), last)
        kv_dtype = cache.kv_dtype(tokens) or torch.bfloat16
        plan = ReusePlan(tokens=tokens, reused=stored, chunks=-(-stored // cache.chunk_size))  # (a piece counts)
        return run_plan(store_prefix(cache, tokens, kv_dtype), model, plan, request.continue_tokens,
                        request.compares, stage)


def _load_model(request: ReplayRequest, stage: Callable[[str], None]) -> Engine:
    """The request's model in its engine (`ops.engines.open_engine`)."""
    stage("loading the model")
    return open_engine(request)


def _new_prompt_tokens(request: ReplayRequest, model: "AnyModel") -> list[int] | None:
    """The new prompt's token ids (`prompt`, or read from `prompt_file`; `chat`: as a user message
    in the model's chat template), None without one."""
    from .capture import encode_prompt

    if request.prompt is None and request.prompt_file is None:
        return None
    text = read_text_file(request.prompt_file) if request.prompt_file is not None else request.prompt
    return encode_prompt(model, check_text(text, "--prompt"), request.chat, request.generation_prompt)


def _suffix_tokens(request: ReplayRequest, model: "AnyModel") -> list[int] | None:
    """The suffix's token ids (`suffix`, or read from `suffix_file`; no special tokens: it goes on
    after the cached ones), None without one."""
    if request.suffix is None and request.suffix_file is None:
        return None
    text = read_text_file(request.suffix_file) if request.suffix_file is not None else request.suffix
    return model.tokenizer.encode(check_text(text, "--suffix"), add_special_tokens=False)


def _check_thresholds(result: ReplayResult, min_top1: float | None, max_kl: float | None) -> ReplayResult:
    result.thresholds = {"min_top1": min_top1, "max_kl": max_kl}
    if min_top1 is not None and not result.top1_agreement >= min_top1:  # (NaN fails too)
        result.failures.append(f"top-1 agreement {result.top1_agreement:.3f} < {min_top1}")
    if max_kl is not None and not result.kl_mean <= max_kl:
        result.failures.append(f"mean KL {result.kl_mean:.3g} > {max_kl}")
    if result.failures:
        raise ToleranceExceeded(f"replay below threshold: {'; '.join(result.failures)}", report=result)
    return result


def replay_plan(prefix: "Prefix | ContainerReader", model: "AnyModel", plan: ReusePlan, *,
                continue_tokens: int = 32, compare: bool = False, block_size: int = 16,
                on_stage: Callable[[str], None] | None = None, allow_other_weights: bool = False) -> ReplayResult:
    """Run `plan` on a prefix (`file_prefix`, `store_prefix`; an open file is taken as its
    `file_prefix`): load its reused tokens, compute the rest, continue greedily, and with
    `compare` measure against a full recompute. (The Python entry below `replay`: its count of
    tokens to continue is checked here, as `ReplayRequest` checks the command's.)"""
    if isinstance(prefix, ContainerReader):
        prefix = file_prefix(prefix, model, allow_other_weights)
    continuation(continue_tokens)
    return run_plan(prefix, model, plan, continue_tokens, compare, on_stage or _no_stage, block_size)


def run_plan(prefix: Prefix, model: "AnyModel", plan: ReusePlan, continue_tokens: int, compare: bool,
             stage: Callable[[str], None], block_size: int = 16) -> ReplayResult:
    """A replay's steps once its inputs are checked, in whichever engine runs the model: the full
    recompute (with `compare`, the reference, run first), the prefix loaded into a fresh sequence
    of the engine's cache (`start_from_prefix`), the continuation (greedy, or teacher-forced along
    the reference and measured: `continue_or_measure`), the result."""
    engine = as_engine(model)
    n = len(plan.tokens)
    check_context(engine, n, continue_tokens)
    engine.warm_up(prefix.kv_dtype, _codecs_to_warm(prefix))
    reference = None
    if compare:
        stage(f"recomputing {n} tokens and {continue_tokens} more{engine.recompute_label} (the reference)")
        reference = engine.recompute(plan.tokens, continue_tokens, prefix.kv_dtype, block_size, prefix.chunk_size)
    source = "the file" if prefix.reader is not None else "the store"
    if not plan.reused:  # the run goes on (a recompute is a valid answer), but never silently
        notice(f"{prefix.source} shares no tokens with the prompt: nothing is loaded, all {n} tokens are computed")
    stage(f"loading {plan.reused} tokens from {source}{engine.cache_label} and continuing")
    start = start_from_prefix(prefix, engine, plan, n + continue_tokens, block_size)
    generated, ttft_s, measured = continue_or_measure(engine, start, reference, continue_tokens, prefix.chunk_size)
    return replay_result(prefix, engine, start, ttft_s, generated, measured)


def check_context(model: "AnyModel", num_tokens: int, continue_tokens: int) -> None:
    """The prompt and the tokens to generate fit the model's context."""
    if num_tokens + continue_tokens > model.max_position_embeddings:
        raise PromptError(f"{num_tokens} tokens plus {continue_tokens} to generate exceed the model's context of "
                          f"{model.max_position_embeddings}")


def _codecs_to_warm(prefix: Prefix) -> tuple[str, ...]:
    """The codecs a prefix may decode: a file's own, or (the store's) every codec."""
    return tuple(prefix.codecs) if prefix.reader is not None else tuple(codecs.codec_names())


@dataclass(frozen=True)
class CachedStart:
    """A replay's sequence in the engine's cache once the prefix is loaded into it: what the
    continuation starts from."""

    seq: CachedSequence  # holding the prompt's reused KV
    plan: ReusePlan  # as loaded: fewer reused tokens when the store could not give them all
    reused: int  # tokens whose KV came from the prefix
    first_from: str  # "hidden_states" or "prefill"
    first: torch.Tensor | None  # [1, V], the first new token's logits when known (from the stored hidden states)
    load_s: float
    started: float  # (time.perf_counter) the start of the load: the cached run's time to first token runs from it
    notice: str | None  # why less was reused than planned


def start_from_prefix(prefix: Prefix, engine: Engine, plan: ReusePlan, total: int, block_size: int) -> CachedStart:
    """A fresh sequence of `total` slots in the engine's cache (kvtool's: shuffled paged blocks), the
    plan's reused tokens loaded into it through the one load path (`kvtool.load.load`), and where
    the plan reuses every token, the first new token's logits from the file's stored hidden
    states (`hidden_start`)."""
    seq = engine.new_sequence(total, prefix.kv_dtype, block_size, seed=1)
    synchronize(engine.device)
    started = time.perf_counter()
    loaded = seq.load(prefix.load, plan.reused)
    synchronize(engine.device)
    load_s = time.perf_counter() - started
    why = None
    if loaded < plan.reused:  # the store refused or lost a chunk: the rest is computed
        why = f"{plan.reused - loaded} cached tokens could not be loaded: computed"
        plan = ReusePlan(tokens=plan.tokens, reused=loaded, chunks=-(-loaded // prefix.chunk_size))
    first, reused, first_from, unusable = None, plan.reused, "prefill", None
    if plan.from_hidden:
        first, reused, first_from, unusable = hidden_start(prefix, engine, plan)
    return CachedStart(seq, plan, reused, first_from, first, load_s, started,
                       unusable if unusable is not None else why)


def hidden_start(prefix: Prefix, engine: Engine, plan: ReusePlan) -> tuple[torch.Tensor | None, int, str, str | None]:
    """The first new token's logits [1, V] from the file's stored hidden state of the last token.
    Returns (logits, tokens reused, "hidden_states", None), or where the stored hidden states are
    unusable (None, all but the last token, "prefill", why): the last token is then recomputed."""
    n = len(plan.tokens)
    try:
        hidden = last_hidden_state(prefix.reader, engine, n)  # [1, E]
    except DataError as err:  # the KV is intact: recompute the last token instead
        notice(f"the stored hidden states are unusable ({err}); the last token is recomputed")
        return None, n - 1, "prefill", f"hidden_states unusable: {err}"
    return engine.logits_from_hidden(hidden), plan.reused, "hidden_states", None


def continue_or_measure(engine: Engine, start: CachedStart, reference: Reference | None, continue_tokens: int,
                        prefill_chunk: int) -> tuple[list[int], float, dict[str, Any]]:
    """From the loaded prefix: without a reference, greedy decoding (the engine's own: transformers'
    `generate`); with one, the first new token's logits, then the cached run teacher-forced along
    the reference's continuation and measured against it (`kvtool.ops.compare.measure`). Returns
    (the continuation: the reference's with a measure, the cached run's time to first token, the
    measurements: `ReplayResult` fields)."""
    tokens, reused, seq = start.plan.tokens, start.reused, start.seq
    if reference is None:
        synchronize(engine.device)
        before = time.perf_counter() - start.started
        generated, first_s = seq.generate(tokens, reused, continue_tokens, start.first, prefill_chunk)
        return generated, before + first_s, {}
    first = start.first if start.first is not None else seq.prefill(tokens, reused, "last", prefill_chunk)
    synchronize(engine.device)
    ttft_s = time.perf_counter() - start.started
    compared, own = measure(reference.logits, reference.tokens, seq, tokens, first, prefill_chunk)
    same = compared["greedy_identical_tokens"]
    return reference.tokens, ttft_s, {
        "ttft_recompute_s": reference.ttft_s, "speedup": reference.ttft_s / max(ttft_s, 1e-9), **compared,
        "cached_continuation_tokens": own, "cached_continuation": engine.tokenizer.decode(own),
        "agreed_continuation": engine.tokenizer.decode(reference.tokens[:same])}


def replay_result(prefix: Prefix, engine: Engine, start: CachedStart, ttft_s: float, generated: list[int],
                  measured: dict[str, Any]) -> ReplayResult:
    n, reused_any = len(start.plan.tokens), start.plan.reused > 0
    return ReplayResult(
        file=prefix.source, model=engine.name, num_tokens=n, reused_tokens=start.reused,
        computed_tokens=n - start.reused, chunks_loaded=start.plan.chunks,
        codecs=sorted(set(prefix.codecs)) if reused_any else [], device=describe(engine.device),
        model_dtype=str(engine.dtype).removeprefix("torch."), first_token_from=start.first_from,
        weights=prefix.weights if reused_any else "nothing reused", load_s=start.load_s,
        ttft_cached_s=ttft_s, continue_tokens=len(generated), continuation_tokens=generated,
        continuation=engine.tokenizer.decode(generated), notice=start.notice, engine=engine.kind, **measured)


def last_hidden_state(reader: ContainerReader, model: "AnyModel", n: int) -> torch.Tensor:
    """The file's final hidden state of token n - 1, [1, E], on the model's device."""
    hidden = reader.read_extra("hidden_states")  # [num_tokens, E]
    if hidden.shape[1] != model.config.hidden_size:
        raise ShapeMismatch(f"hidden_states are {list(hidden.shape)}, the model's hidden size is "
                            f"{model.config.hidden_size}")
    last = hidden[n - 1:n]
    if not bool(torch.isfinite(last).all()):
        raise NonFiniteValues(f"hidden state of token {n - 1} is not finite")
    return last.to(model.device)


# Names this module had before the engines were one interface: each answers with what to use.
__getattr__ = moved_names(__name__, {
    "run_hf_plan": ("run_plan, which runs any engine", lambda: run_plan),
    "greedy": ("kvtool.ops.engines.greedy", lambda: engines.greedy),
    "recompute": ("Engine.recompute, or kvtool.ops.engines.recompute", lambda: engines.recompute),
    "warm_up": ("Engine.warm_up", None),
    "first_logits": ("hidden_start, or CachedSequence.prefill", None),
    "free_run_after": ("kvtool.ops.compare.own_continuation", None),
    "measure_against": ("kvtool.ops.compare.measure", None),
})
