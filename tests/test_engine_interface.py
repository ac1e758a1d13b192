"""One engine interface (issue 47, finding 3): `capture` and `replay` hold one path over
`kvtool.engine.protocol.Engine`, with no branch on an engine's type, and the measure against a
recompute is written once (`kvtool.ops.compare.measure`) for every engine.

A toy engine, written here against the interface alone (no model, no transformers), runs the
whole `capture` and `replay --compare` path: its KV goes into a real file through the real
writer, comes back through `kvtool.load` into its own buffers, and its continuation and measure
are the ones its arithmetic predicts, also where the cached run parts from the recompute. Before
the interface, any model that was not kvtool's `LoadedModel` was taken for a transformers model.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvtool
from kvtool.connectors import PagedMemConnectorV2
from kvtool.engine.protocol import CachedSequence, Engine, Reference
from kvtool.identity import ModelIdentity

OPS = Path(kvtool.__file__).parent / "ops"
VOCAB, LAYERS, WIDTH = 32, 2, 4  # one KV head of 4: a token's K is its id in every lane, its V minus that


# --- a toy engine: the next token is the sum of the cached keys so far, mod the vocabulary ------------


class ToyTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ",".join(str(i) for i in ids)


class ToyModel:
    """What the toy engine wraps: the facts an `Engine` delegates to its model."""

    name = "toy"
    identity = ModelIdentity(name="toy", architecture="ToyForTest", num_layers=LAYERS, num_attention_heads=1,
                             num_kv_heads=1, head_dim=WIDTH, hidden_size=WIDTH, intermediate_size=0,
                             vocab_size=VOCAB, rms_norm_eps=0.0, tie_word_embeddings=False)
    config = SimpleNamespace(vocab_size=VOCAB)
    tokenizer = ToyTokenizer()
    device = torch.device("cpu")
    dtype = torch.float32
    max_position_embeddings = 1024


def kv_of(tokens: list[int]) -> torch.Tensor:
    """KV_BLOB [2, L, n, C] of the toy's tokens."""
    k = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(LAYERS, len(tokens), WIDTH)
    return torch.stack([k, -k])


class ToySequence(CachedSequence):
    """Each layer's K and V as a paged buffer of one block ([1, T, 1, C], the kv_tuple layout)."""

    def __init__(self, total: int):
        self.keys = [torch.zeros(1, total, 1, WIDTH) for _ in range(LAYERS)]
        self.values = [torch.zeros(1, total, 1, WIDTH) for _ in range(LAYERS)]

    def load(self, load, num_tokens: int) -> int:
        connector = PagedMemConnectorV2(WIDTH, LAYERS, layout="kv_tuple", num_kv_heads=1, head_dim=WIDTH)
        target = connector.target(kvcaches=list(zip(self.keys, self.values)),
                                  slot_mapping=torch.arange(self.keys[0].shape[1]))
        return load(target, num_tokens) if num_tokens else 0

    def prefill(self, tokens, start, logits, prefill_chunk):
        kv = kv_of(tokens[start:])
        for layer in range(LAYERS):
            self.keys[layer][0, start:len(tokens), 0] = kv[0, layer]
            self.values[layer][0, start:len(tokens), 0] = kv[1, layer]
        sums = self.keys[0][0, :len(tokens), 0, 0].cumsum(0)[start:]  # what each position has seen
        out = torch.nn.functional.one_hot(sums.long() % VOCAB, VOCAB).float() * 10  # [n - start, V]
        return out[-1:] if logits == "last" else out

    def generate(self, tokens, start, max_new_tokens, first, prefill_chunk):
        first = self.prefill(tokens, start, "last", prefill_chunk) if first is None else first
        new = [int(first[0].argmax())]
        while len(new) < max_new_tokens:
            new.append(int(self.prefill(tokens + new, len(tokens) + len(new) - 1, "last", 0)[0].argmax()))
        return new, 0.0

    def continue_from(self, tokens, keep, max_new_tokens):
        new: list[int] = []
        while len(new) < max_new_tokens:
            seen = tokens + new
            new.append(int(self.prefill(seen, len(seen) - 1, "last", 0)[0].argmax()))
        return new


class ToyEngine(Engine):
    kind = "toy"
    adds_special_tokens = False
    starts_from_hidden_states = False

    def __init__(self, skew_at: int | None = None):
        super().__init__(ToyModel())
        self.skew_at = skew_at  # a captured token whose stored key is off by one: the cached run parts there

    def run_metadata(self, block_size):
        return {"engine": "toy"}

    def capture_block_size(self, block_size, num_tokens):
        return num_tokens

    def capture_steps(self, num_tokens, *, kv_dtype, block_size, shuffle_seed, prefill_chunk, blob_device, pinned):
        engine = self

        class Steps:
            def prefill(self, token_ids, start, end, hidden):
                self.tokens = token_ids

            def gather(self, start, end):
                kv = kv_of(self.tokens[start:end])
                if engine.skew_at is not None and start <= engine.skew_at < end:
                    kv[0, :, engine.skew_at - start] += 1
                return kv.to(kv_dtype)

        return Steps()

    def new_sequence(self, total, kv_dtype, block_size, seed):
        return ToySequence(total)

    def recompute(self, tokens, continue_tokens, kv_dtype, block_size, prefill_chunk):
        seq = ToySequence(len(tokens) + continue_tokens)
        logits = [seq.prefill(tokens, 0, "last", prefill_chunk)[0]]
        generated = [int(logits[0].argmax())]
        while len(generated) < continue_tokens:
            logits.append(seq.prefill(tokens + generated, len(tokens) + len(generated) - 1, "last", 0)[0])
            generated.append(int(logits[-1].argmax()))
        return Reference(torch.stack(logits), generated, 0.0)


def predicted(tokens: list[int], count: int, skew: int = 0) -> list[int]:
    """The toy's greedy continuation: each next token the running sum of the keys seen, mod V."""
    total, new = sum(tokens) + skew, []
    for _ in range(count):
        new.append(total % VOCAB)
        total += new[-1]
    return new


PROMPT, SUFFIX = "kvtool ops", " go"


def test_a_third_engine_captures_and_replays_through_the_one_path(tmp_path):
    ids = ToyTokenizer().encode(PROMPT)
    path = tmp_path / "toy.kvc"
    captured = kvtool.capture(ToyEngine(), ids, path, chunk_size=4, kv_dtype=torch.float32)
    assert (captured.engine, captured.block_size, captured.num_chunks) == ("toy", len(ids), 3)
    with kvtool.open(path) as reader:
        assert reader.manifest.metadata["engine"] == "toy"
        assert torch.equal(reader.read_range(0, len(ids)), kv_of(ids))

    result = kvtool.replay(path, model=ToyEngine(), suffix=SUFFIX, compare=True, continue_tokens=5)
    tokens = ids + ToyTokenizer().encode(SUFFIX)
    assert (result.engine, result.reused_tokens, result.computed_tokens) == ("toy", len(ids), 3)
    assert result.continuation_tokens == predicted(tokens, 5)  # the recompute's
    assert result.cached_continuation_tokens == predicted(tokens, 5)
    assert (result.greedy_identical_tokens, result.top1_agreement, result.kl_max) == (5, 1.0, 0.0)

    plain = kvtool.replay(path, model=ToyEngine(), suffix=SUFFIX, continue_tokens=5)
    assert plain.continuation_tokens == predicted(tokens, 5) and plain.top1_agreement is None


def test_the_measure_follows_a_cached_run_that_parts_from_the_recompute(tmp_path):
    """A stored key off by one: the cached run's first token differs, so the measure counts no
    identical greedy token, and its own continuation is the skewed sum's, decoded after the
    teacher-forced tokens were cut back."""
    ids = ToyTokenizer().encode(PROMPT)
    path = tmp_path / "skewed.kvc"
    kvtool.capture(ToyEngine(skew_at=2), ids, path, chunk_size=4, kv_dtype=torch.float32)
    result = kvtool.replay(path, model=ToyEngine(), suffix=SUFFIX, compare=True, continue_tokens=4)
    tokens = ids + ToyTokenizer().encode(SUFFIX)
    assert result.continuation_tokens == predicted(tokens, 4)
    assert result.cached_continuation_tokens == predicted(tokens, 4, skew=1)
    assert result.greedy_identical_tokens == 0 and result.agreed_continuation == ""


def test_capture_and_replay_hold_no_branch_on_an_engine_type():
    """`isinstance` on a model's type, or an import of a particular engine's integration, lives
    in `ops/engines.py` alone (choosing the engine); the operations run the interface."""
    engine_types = {"LoadedModel", "HFModel", "HFEngine", "KvtoolEngine", "PreTrainedModel"}
    for name in ("capture.py", "replay.py", "blend.py", "compare.py"):
        tree = ast.parse((OPS / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not named & engine_types, f"ops/{name}:{node.lineno} branches on {named & engine_types}"
            if isinstance(node, ast.ImportFrom):
                assert "integrations" not in (node.module or ""), f"ops/{name}:{node.lineno} imports {node.module}"


@pytest.mark.parametrize("name, use", [("run_hf_plan", "run_plan"), ("greedy", "kvtool.ops.engines.greedy"),
                                       ("recompute", "Engine.recompute, or kvtool.ops.engines.recompute")])
def test_a_moved_replay_name_still_answers_with_what_to_use(name, use):
    import kvtool.ops.replay as replay

    with pytest.warns(DeprecationWarning, match=f"kvtool.ops.replay.{name} is deprecated: use {use}"):
        assert callable(getattr(replay, name))
