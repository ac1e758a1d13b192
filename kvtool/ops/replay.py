"""Replay: load a KV file into a fresh paged buffer and continue from it.

The file's chunks are decoded and written into a newly allocated paged cache,
with a shuffled (non-contiguous) block assignment, through
`PagedMemConnectorV2.to_gpu` and the new sequence's slot mapping. The model then
computes only what the file does not hold. `compare` measures the cached run
against a full recompute of the same tokens:

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
from ..engine import LoadedModel, Runner, logits_from_hidden
from ..errors import DataError, NonFiniteValues, PromptError, ShapeMismatch, ToleranceExceeded
from ..format import ContainerReader
from ..format.hashing import prefix_hashes
from ..format.made_by import check_made_by, check_vocabulary
from ..fsutil import read_text_file
from ..load import file_tasks, load
from ..notices import notice
from .compare import compare_logits
from .engine_io import new_cache, paged_connector
from .inputs import check_text, continuation
from .requests import ReplayRequest
from .result import Result

if TYPE_CHECKING:  # (imports transformers: loaded only for --engine hf)
    from ..integrations.hf.models import HFModel
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


def replay(path: str | Path | None, model: str | Path | LoadedModel | None = None, *, continue_tokens: int = 32,
           suffix: str | None = None, suffix_file: Path | None = None, prompt: str | None = None,
           prompt_file: Path | None = None, compare: bool = False, min_top1: float | None = None,
           max_kl: float | None = None, device: str = "auto", model_dtype: str = "fp32",
           use_hidden_states: bool = True, chat: bool = False, generation_prompt: bool = True,
           allow_other_weights: bool = False, store: str | None = None, chunk_size: int | None = None,
           namespace: str | None = None, engine: str = "kvtool",
           on_stage: Callable[[str], None] | None = None) -> ReplayResult:
    """Load a KV file into a fresh paged buffer and continue from it (`kvtool replay`).

    `suffix` continues the file's own tokens; `prompt` reuses the file's chunks that a new
    prompt shares. `min_top1` / `max_kl` (each implies `compare`) raise ToleranceExceeded,
    carrying the result, when the cached run falls outside them. `on_stage(text)` says what
    it is doing (a progress display).

    With `store` (a URL) instead of `path`, the longest cached prefix of the prompt comes from
    the chunk store (format-spec/store.md) at `chunk_size` (None: the stored size that covers
    the most), and the rest is computed; `namespace`: only chunks stored under it.

    `engine` "hf" replays with transformers (`model`: a folder, a Hub id in the local cache or a
    transformers model): the prefix loads into a transformers cache and `generate` continues.

    The options become one `ReplayRequest` (checked there), run by `run_replay`."""
    request = ReplayRequest(path=path, model=model, continue_tokens=continue_tokens, suffix=suffix,
                            suffix_file=suffix_file, prompt=prompt, prompt_file=prompt_file, compare=compare,
                            min_top1=min_top1, max_kl=max_kl, device=device, model_dtype=model_dtype,
                            use_hidden_states=use_hidden_states, chat=chat, generation_prompt=generation_prompt,
                            allow_other_weights=allow_other_weights, store=store, chunk_size=chunk_size,
                            namespace=namespace, engine=engine)
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
        model = _load_model(request, stage)
        prefix = file_prefix(reader, model, request.allow_other_weights)  # the file was made by this model
        # transformers' convention computes the prompt's last token: its stored hidden state is not used
        plan = plan_reuse(reader, new_tokens=_new_prompt_tokens(request, model),
                          suffix_tokens=_suffix_tokens(request, model),
                          use_hidden_states=request.use_hidden_states and isinstance(model, LoadedModel))
        return run_plan(prefix, model, plan, request.continue_tokens, request.compares, stage)


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


def _load_model(request: ReplayRequest, stage: Callable[[str], None]) -> "AnyModel":
    """The request's model in its engine (`ops.capture.engine_model`)."""
    from .capture import engine_model

    stage("loading the model")
    return engine_model(request)


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


def replay_plan(prefix: "Prefix | ContainerReader", model: LoadedModel, plan: ReusePlan, *,
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
    """A replay's steps once its inputs are checked: the full recompute (with `compare`, the
    reference, run first), the prefix loaded and the first new token's logits
    (`start_from_prefix`), the continuation (greedy, or teacher-forced along the reference and
    measured: `measure_against`), the result. A transformers model runs `run_hf_plan`."""
    if not isinstance(model, LoadedModel):
        return run_hf_plan(prefix, model, plan, continue_tokens, compare, stage)
    n = len(plan.tokens)
    check_context(model, n, continue_tokens)
    warm_up(model, prefix)
    reference = None
    if compare:
        stage(f"recomputing {n} tokens and {continue_tokens} more (the reference)")
        reference = recompute(model, plan.tokens, continue_tokens, prefix.kv_dtype, block_size, prefix.chunk_size)
    source = "the file" if prefix.reader is not None else "the store"
    stage(f"loading {plan.reused} tokens from {source} and continuing")
    start = start_from_prefix(prefix, model, plan, n + continue_tokens, block_size)
    if reference is None:
        generated, measured = greedy(start.runner, start.seq, start.first, continue_tokens), {}
    else:
        generated, measured = measure_against(reference, start, model, continue_tokens, prefix.chunk_size)
    return replay_result(prefix, model, start, continue_tokens, generated, measured)


def check_context(model: "AnyModel", num_tokens: int, continue_tokens: int) -> None:
    """The prompt and the tokens to generate fit the model's context."""
    if num_tokens + continue_tokens > model.max_position_embeddings:
        raise PromptError(f"{num_tokens} tokens plus {continue_tokens} to generate exceed the model's context of "
                          f"{model.max_position_embeddings}")


@dataclass(frozen=True)
class CachedStart:
    """A replay's paged cache once the prefix is loaded into it and the first new token's logits
    exist: what the continuation starts from."""

    runner: Runner
    seq: Any  # the sequence in the runner's cache, holding the prompt's KV
    plan: ReusePlan  # as loaded: fewer reused tokens when the store could not give them all
    reused: int  # tokens whose KV came from the prefix
    first_from: str  # "hidden_states" or "prefill"
    first: torch.Tensor  # [1, V], the first new token's logits
    load_s: float
    ttft_s: float  # from the start of the load to the first logits
    notice: str | None  # why less was reused than planned


def start_from_prefix(prefix: Prefix, model: LoadedModel, plan: ReusePlan, total: int,
                      block_size: int) -> CachedStart:
    """A fresh shuffled paged cache of `total` slots, the plan's reused tokens loaded into it
    through the one load path (`kvtool.load.load`), then the first new token's logits
    (`first_logits`); timed from the start of the load."""
    cache, seq = new_cache(model, total, prefix.kv_dtype, block_size, seed=1)
    slot_mapping = seq.slot_mapping(total, device=model.device)  # [total]
    runner = Runner(model, cache)
    synchronize(model.device)
    t0 = time.perf_counter()
    # the one load path; slots checked on the host: no device sync per chunk (the copy is small)
    target = paged_connector(model).target(kvcaches=cache.kv_caches, slot_mapping=slot_mapping.cpu())
    loaded = prefix.load(target, plan.reused) if plan.reused else 0
    seq.num_tokens = loaded
    synchronize(model.device)
    load_s = time.perf_counter() - t0
    why = None
    if loaded < plan.reused:  # the store refused or lost a chunk: the rest is computed
        why = f"{plan.reused - loaded} cached tokens could not be loaded: computed"
        plan = ReusePlan(tokens=plan.tokens, reused=loaded, chunks=-(-loaded // prefix.chunk_size))
    first, reused, first_from, unusable = first_logits(runner, seq, prefix, model, plan)
    synchronize(model.device)
    return CachedStart(runner, seq, plan, reused, first_from, first, load_s, time.perf_counter() - t0,
                       unusable if unusable is not None else why)


def first_logits(runner: Runner, seq, prefix: Prefix, model: LoadedModel,
                 plan: ReusePlan) -> tuple[torch.Tensor, int, str, str | None]:
    """The first new token's logits [1, V]: from the file's stored hidden state of the last token
    when the plan reuses every token, else by prefilling what the plan does not reuse. Returns
    (logits, tokens reused, "hidden_states" or "prefill", why the hidden states were unusable)."""
    tokens, n = plan.tokens, len(plan.tokens)
    if not plan.from_hidden:
        return (runner.prefill(seq, tokens[plan.reused:], start_pos=plan.reused, prefill_chunk=prefix.chunk_size,
                               logits="last"), plan.reused, "prefill", None)
    try:
        hidden = last_hidden_state(prefix.reader, model, n)  # [1, E]
    except DataError as err:  # the KV is intact: recompute the last token instead
        notice(f"the stored hidden states are unusable ({err}); the last token is recomputed")
        first = runner.prefill(seq, tokens[n - 1:], start_pos=n - 1, logits="last")  # rewrites its own slot
        return first, n - 1, "prefill", f"hidden_states unusable: {err}"
    return logits_from_hidden(model.weights, hidden, model.config.final_softcap), plan.reused, "hidden_states", None


def greedy(runner: Runner, seq, first: torch.Tensor, continue_tokens: int) -> list[int]:
    """Up to `continue_tokens` tokens of greedy decoding, the first from the logits `first` [1, V];
    it stops at the model's end of sequence (included), as `Runner.generate` does."""
    stop = set(runner.config.eos_token_ids)
    generated = [int(first[0].argmax())]
    while len(generated) < continue_tokens and generated[-1] not in stop:
        generated.append(int(runner.decode_step(seq, generated[-1]).argmax()))
    return generated


def measure_against(reference: tuple[torch.Tensor, list[int], float], start: CachedStart, model: LoadedModel,
                    continue_tokens: int, prefill_chunk: int) -> tuple[list[int], dict[str, Any]]:
    """The cached run teacher-forced along the recompute's greedy continuation and compared with
    it position by position (`compare_logits`), then its own greedy continuation from where they
    part. Returns (the reference continuation, the measurements: `ReplayResult` fields)."""
    ref_logits, generated, ttft_recompute = reference  # [N, V], N tokens, seconds
    n = len(start.plan.tokens)
    rest = start.runner.prefill(start.seq, generated[:-1], start_pos=n, prefill_chunk=prefill_chunk, logits="all") \
        if len(generated) > 1 else start.first[:0]
    cached_logits = torch.cat([start.first, rest])  # [N, V]
    measured: dict[str, Any] = {"ttft_recompute_s": ttft_recompute,
                                "speedup": ttft_recompute / max(start.ttft_s, 1e-9),
                                **compare_logits(ref_logits, cached_logits, generated)}
    same = measured["greedy_identical_tokens"]
    own = free_run_after(start.runner, start.seq, n, generated, cached_logits, same)
    measured.update(cached_continuation_tokens=own, cached_continuation=model.tokenizer.decode(own),
                    agreed_continuation=model.tokenizer.decode(generated[:same]))
    return generated, measured


def replay_result(prefix: Prefix, model: LoadedModel, start: CachedStart, continue_tokens: int,
                  generated: list[int], measured: dict[str, Any]) -> ReplayResult:
    n, reused_any = len(start.plan.tokens), start.plan.reused > 0
    return ReplayResult(
        file=prefix.source, model=model.name, num_tokens=n, reused_tokens=start.reused,
        computed_tokens=n - start.reused, chunks_loaded=start.plan.chunks,
        codecs=sorted(set(prefix.codecs)) if reused_any else [], device=describe(model.device),
        model_dtype=str(model.dtype).removeprefix("torch."), first_token_from=start.first_from,
        weights=prefix.weights if reused_any else "nothing reused", load_s=start.load_s,
        ttft_cached_s=start.ttft_s, continue_tokens=len(generated), continuation_tokens=generated,
        continuation=model.tokenizer.decode(generated), notice=start.notice, **measured)


def free_run_after(runner: Runner, seq, n: int, forced: list[int], cached_logits: torch.Tensor,
                   same: int) -> list[int]:
    """The cached run's own greedy continuation: the forced tokens up to the first position
    whose top-1 differs, then its own choice there, then greedy decoding from that point
    (the teacher-forced slots after it are written over)."""
    if same >= len(forced):
        return list(forced)
    own = forced[:same] + [int(cached_logits[same].argmax())]
    seq.num_tokens = n + same  # forget the forced tokens from the first difference on
    while len(own) < len(forced):
        own.append(int(runner.decode_step(seq, own[-1]).argmax()))
    return own


def recompute(model: LoadedModel, tokens: list[int], continue_tokens: int, kv_dtype: torch.dtype,
              block_size: int, prefill_chunk: int) -> tuple[torch.Tensor, list[int], float]:
    """The full recompute, no cache: logits [N, V] along its greedy continuation, the
    continuation, and its time to first token."""
    cache, seq = new_cache(model, len(tokens) + continue_tokens, kv_dtype, block_size, seed=2)
    runner = Runner(model, cache)
    synchronize(model.device)
    t0 = time.perf_counter()
    logits = runner.prefill(seq, tokens, prefill_chunk=prefill_chunk, logits="last")  # [1, V]
    synchronize(model.device)
    ttft = time.perf_counter() - t0
    ref_logits, greedy, stop = [logits[0]], [], set(model.config.eos_token_ids)
    for i in range(continue_tokens):  # up to continue_tokens, stopping at the end of sequence (kept)
        greedy.append(int(ref_logits[-1].argmax()))
        if greedy[-1] in stop:
            break
        if i + 1 < continue_tokens:
            ref_logits.append(runner.decode_step(seq, greedy[-1]))
    return torch.stack(ref_logits), greedy, ttft


# --- with transformers (--engine hf) --------------------------------------------------------------
#
# The prefix (a file's chunks or the store's objects) loads through the one load path into a
# transformers cache (`kvtool.integrations.hf.caches.load_cache`: the contiguous cache as one block
# of a paged buffer) holding at most all but the prompt's last token, transformers' convention;
# `generate` (greedy) continues from it. With `compare`, a fresh `generate` of the whole prompt is
# the reference, and the cached run is teacher-forced along its continuation and measured as for
# kvtool's runner (`compare_logits`).


def run_hf_plan(prefix: Prefix, model: "HFModel", plan: ReusePlan, continue_tokens: int, compare: bool,
                stage: Callable[[str], None]) -> ReplayResult:
    """`run_plan` for a transformers model: the reference (with `compare`), the prefix loaded into
    a transformers cache, the continuation (greedy `generate`, or teacher-forced along the
    reference and measured), the result."""
    from ..integrations.hf.caches import load_cache
    from ..integrations.hf.runs import greedy

    n = len(plan.tokens)
    check_context(model, n, continue_tokens)
    reference = None
    if compare:
        stage(f"recomputing {n} tokens and {continue_tokens} more with transformers (the reference)")
        reference = greedy(model, plan.tokens, None, continue_tokens)
    source = "the file" if prefix.reader is not None else "the store"
    stage(f"loading {plan.reused} tokens from {source} into a transformers cache and continuing")
    synchronize(model.device)
    started = time.perf_counter()
    cache = load_cache(model, plan.reused, prefix.load)
    synchronize(model.device)
    load_s = time.perf_counter() - started
    loaded = cache.get_seq_length()
    why = None
    if loaded < plan.reused:  # the store refused or lost a chunk: the rest is computed
        why = f"{plan.reused - loaded} cached tokens could not be loaded: computed"
        plan = ReusePlan(tokens=plan.tokens, reused=loaded, chunks=-(-loaded // prefix.chunk_size))
    if reference is None:
        generated, _, first_s = greedy(model, plan.tokens, cache, continue_tokens)
        ttft_s, measured = load_s + first_s, {}
    else:
        generated, ttft_s, measured = _measure_hf(model, plan, cache, reference, started)
    reused = plan.reused
    return ReplayResult(
        file=prefix.source, model=model.name, num_tokens=n, reused_tokens=reused, computed_tokens=n - reused,
        chunks_loaded=plan.chunks, codecs=sorted(set(prefix.codecs)) if reused else [],
        device=describe(model.device), model_dtype=str(model.dtype).removeprefix("torch."),
        first_token_from="prefill", weights=prefix.weights if reused else "nothing reused", load_s=load_s,
        ttft_cached_s=ttft_s, continue_tokens=len(generated), continuation_tokens=generated,
        continuation=model.tokenizer.decode(generated), notice=why, engine="hf", **measured)


def _measure_hf(model: "HFModel", plan: ReusePlan, cache, reference: tuple[list[int], torch.Tensor, float],
                started: float) -> tuple[list[int], float, dict[str, Any]]:
    """The cached run teacher-forced along the reference's continuation and compared with it
    position by position, then its own greedy continuation from where they part (the cache cut
    back there). Returns (the reference continuation, the cached run's time to first token,
    the measurements: `ReplayResult` fields)."""
    from ..integrations.hf.runs import forced_logits, greedy

    generated, ref_logits, ttft_recompute = reference
    n = len(plan.tokens)
    first = forced_logits(model, plan.tokens, cache, plan.reused)[-1:]  # [1, V]: the first new token's
    synchronize(model.device)
    ttft_s = time.perf_counter() - started
    rest = forced_logits(model, plan.tokens + generated[:-1], cache, n) if len(generated) > 1 else first[:0]
    cached_logits = torch.cat([first, rest])  # [N, V]
    measured: dict[str, Any] = {"ttft_recompute_s": ttft_recompute, "speedup": ttft_recompute / max(ttft_s, 1e-9),
                                **compare_logits(ref_logits, cached_logits, generated)}
    same = measured["greedy_identical_tokens"]
    own = list(generated)
    if same < len(generated):  # from the first difference on, the cached run's own choices
        own = generated[:same] + [int(cached_logits[same].argmax())]
        surplus = len(generated) - 1 - same  # teacher-forced tokens past the difference: the cache keeps n + same
        if surplus:
            cache.crop(-surplus)
        if len(own) < len(generated):
            own += greedy(model, plan.tokens + own, cache, len(generated) - len(own))[0]
    measured.update(cached_continuation_tokens=own, cached_continuation=model.tokenizer.decode(own),
                    agreed_continuation=model.tokenizer.decode(generated[:same]))
    return generated, ttft_s, measured


def last_hidden_state(reader: ContainerReader, model: LoadedModel, n: int) -> torch.Tensor:
    """The file's final hidden state of token n - 1, [1, E], on the model's device."""
    hidden = reader.read_extra("hidden_states")  # [num_tokens, E]
    if hidden.shape[1] != model.config.hidden_size:
        raise ShapeMismatch(f"hidden_states are {list(hidden.shape)}, the model's hidden size is "
                            f"{model.config.hidden_size}")
    last = hidden[n - 1:n]
    if not bool(torch.isfinite(last).all()):
        raise NonFiniteValues(f"hidden state of token {n - 1} is not finite")
    return last.to(model.device)


_warmed: set[tuple[str, tuple[str, ...]]] = set()


def warm_up(model: LoadedModel, prefix: Prefix) -> None:
    """On a GPU, pay the one-time costs (kernel builds and loads, library handles, lazy
    modules) before anything is timed: each codec of the prefix warms itself up (the store's:
    every codec), the paged copy kernel loads, one tiny prefill runs. Nothing to do on the CPU."""
    from ..connectors.paged_copy import load_cuda_kernel

    names = tuple(prefix.codecs) if prefix.reader is not None else tuple(codecs.codec_names())
    key = (str(model.device), names)
    if model.device.type != "cuda" or key in _warmed:
        return
    _warmed.add(key)
    load_cuda_kernel()
    for name in names:
        codecs.get_codec(name).warm_up(model.device)
    cache, seq = new_cache(model, 2, prefix.kv_dtype, 16, seed=0)
    Runner(model, cache).prefill(seq, [0, 0], logits="last")
    synchronize(model.device)
