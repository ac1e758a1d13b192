"""Every way KV enters a model passes the load path's checks (issue 47): a chunk of NaN written with
a valid CRC through the public writers (`ContainerWriter`, `ModelCache.put_sequence`), and a chunk
with one payload byte flipped, never reach a model.

One test per entry point, each for both kinds of damage, on a tiny random Llama (kvtool's engine
and transformers load it in a second) and a capture of one prompt in 8-token chunks, the damage in
chunk 1 (tokens 8..15):

- a file: `replay FILE`, `replay --blend FILE`, `kvtool.hf.to_cache(FILE)`: refused in one line
  (NonFiniteValues, ChecksumMismatch; exit 1), before the model runs; `kvtool.hf.to_cache` of a
  safetensors dump refuses a NaN too (a dump has no CRC);
- the store: `replay --store`, `replay --blend-delimiter ... --store`, the prefix API
  (`ModelCache.get_prefix` / `load_prefix`), `kvtool.hf.to_cache(STORE)`: the damaged object is
  refused (a miss, removed), the prefix ends before it and the rest is computed: what the model
  gives is finite and agrees with a full recompute.

The vLLM connector loads through `ModelCache.load_prefix` too (kvtool/integrations/vllm/worker.py);
its engine-level test of damaged objects is tests/test_vllm_connector.py
(`test_failed_loads_heal_the_store_and_never_pollute_it`), and a NaN object on `load_prefix`'s
every path (native, torch, staged, memory tier) is tests/test_hostile_store.py's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fixtures import cli, save_tiny_model

pytest.importorskip("transformers")

from kvtool.errors import ChecksumMismatch, NonFiniteValues  # noqa: E402
from kvtool.format import ContainerReader, ContainerWriter  # noqa: E402
from kvtool.identity import ModelIdentity  # noqa: E402
from kvtool.store import open_store  # noqa: E402

TEXT = "Alice lives in Paris and bakes bread daily."  # 43 tokens (one a byte): chunks 0..4 whole, 5 short
QUESTION = " Where does Alice live?"
CHUNK = 8
BAD = 1  # the damaged chunk: tokens 8..15; a load keeps chunk 0
REFUSED = {"nan": ("NonFiniteValues", NonFiniteValues), "flip": ("ChecksumMismatch", ChecksumMismatch)}
DAMAGES = sorted(REFUSED)


class World:
    """The tiny model's folder and a good capture of TEXT: its KV, tokens and identity."""

    def __init__(self, folder: Path, good: Path):
        self.folder, self.good = folder, good
        with ContainerReader(good) as reader:
            self.kv = reader.read_range(0, reader.num_tokens)  # [2, L, T, C], bf16
            self.tokens = reader.token_ids().tolist()
            self.identity = ModelIdentity.from_dict({k: v for k, v in reader.model.items() if k != "fingerprint"})

    def bad_file(self, path: Path, damage: str) -> Path:
        """TEXT's capture with chunk BAD holding a NaN (written by ContainerWriter: valid CRC), or
        with one byte of its payload flipped."""
        if damage == "nan":
            with ContainerWriter(path, self.identity, self.tokens, kv_dtype=self.kv.dtype, chunk_size=CHUNK) as w:
                for start, end in w.chunk_ranges():
                    w.write_chunk(_with_nan(self.kv)[:, :, start:end], "raw")
            return path
        data = bytearray(self.good.read_bytes())
        with ContainerReader(self.good) as reader:
            blob = reader.chunks[BAD].blob
        data[blob.offset + blob.length // 2] ^= 0x10
        path.write_bytes(bytes(data))
        return path

    def bad_store(self, folder: Path, damage: str) -> str:
        """A store holding TEXT's whole chunks, chunk BAD's object holding a NaN (put by
        `put_sequence`: valid CRCs), or with one byte of its payload flipped in place."""
        url = str(folder)
        with open_store(url) as store:
            cache = store.for_model(self.identity, chunk_size=CHUNK)
            cache.put_sequence(self.tokens, _with_nan(self.kv) if damage == "nan" else self.kv)
            name = cache.chunk_names(self.tokens)[BAD]
        if damage == "flip":
            path = folder / name
            data = bytearray(path.read_bytes())
            payload = bytes(self.kv[:, :, BAD * CHUNK:(BAD + 1) * CHUNK].contiguous().view(-1).view(torch.uint8).numpy())
            at = bytes(data).find(payload)
            assert at > 0  # a raw object holds the chunk's bytes as they are
            data[at + len(payload) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        return url


def _with_nan(kv: torch.Tensor) -> torch.Tensor:
    bad = kv.clone()
    bad[1, 0, BAD * CHUNK + 3, 5] = float("nan")
    return bad


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from kvtool.cli.app import run

    folder = save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    good = folder.parent / "good.kvc"
    assert run(["capture", "--model", str(folder), "--prompt", TEXT, "-o", str(good), "--chunk-size", str(CHUNK),
                "--device", "cpu", "--json"]) == 0
    return World(folder, good)


@pytest.fixture(scope="module")
def hf_model(world):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(world.folder, dtype=torch.float32).eval()


def assert_refused(code: int, out, err: str, damage: str) -> None:
    """One line on stderr, exit 1, the refusal named: the model never ran on the chunk."""
    assert code == 1, (code, out, err)
    assert err.startswith("kvtool: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert out["ok"] is False and out["error"]["type"] == REFUSED[damage][0], out
    assert "chunk 1" in err, err  # the chunk is named


def assert_finite_and_agrees(result: dict) -> None:
    """A run that computed past the refused chunk: the same as a full recompute (the KV of chunk 0
    is bf16, the recompute's float32: close, not equal)."""
    assert result["ok"] and math.isfinite(result["kl_mean"]) and result["kl_mean"] < 1e-2, result
    assert result["top1_agreement"] == 1.0, result


def model_args(world: World) -> list:
    return ["--model", world.folder, "--continue", "2", "--device", "cpu", "--json"]


# --- a file ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", DAMAGES)
def test_replay_of_a_file_refuses_the_chunk(world, tmp_path, capsys, damage):
    bad = world.bad_file(tmp_path / "bad.kvc", damage)
    assert_refused(*cli(capsys, "replay", bad, *model_args(world)), damage)


@pytest.mark.parametrize("damage", DAMAGES)
def test_blend_of_a_segment_file_refuses_the_chunk(world, tmp_path, capsys, damage):
    """The finding of issue 47: `--blend` read its files with `read_range`, which checks the CRC
    but not the values, and blended a NaN into the model's cache."""
    bad = world.bad_file(tmp_path / "bad.kvc", damage)
    assert_refused(*cli(capsys, "replay", "--blend", bad, "--prompt", QUESTION, *model_args(world)), damage)


@pytest.mark.parametrize("damage", DAMAGES)
def test_hf_to_cache_of_a_file_refuses_the_chunk(world, hf_model, tmp_path, damage):
    import kvtool.hf

    bad = world.bad_file(tmp_path / "bad.kvc", damage)
    with pytest.raises(REFUSED[damage][1], match="chunk 1"):
        kvtool.hf.to_cache(bad, hf_model)


def test_hf_to_cache_of_a_dump_refuses_a_nan(world, hf_model, tmp_path, capsys):
    """A safetensors dump (`kvtool dump` copies a file's values as they are) goes through the load
    path too. It carries no CRC: a flipped byte in it is a changed value no reader can tell."""
    import kvtool.hf

    dump = tmp_path / "bad.safetensors"
    assert cli(capsys, "dump", world.bad_file(tmp_path / "bad.kvc", "nan"), "-o", dump)[0] == 0
    with pytest.raises(NonFiniteValues, match="bad.safetensors: holds NaN"):
        kvtool.hf.to_cache(dump, hf_model)


# --- the store ------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", DAMAGES)
def test_replay_from_the_store_stops_before_the_chunk(world, tmp_path, capsys, damage):
    store = world.bad_store(tmp_path / "store", damage)
    code, result, err = cli(capsys, "replay", "--store", store, "--prompt", TEXT, "--compare", *model_args(world))
    assert code == 0, err
    assert result["reused_tokens"] == BAD * CHUNK and result["chunks_loaded"] == BAD
    assert_finite_and_agrees(result)


@pytest.mark.parametrize("damage", DAMAGES)
def test_blend_from_the_store_stops_before_the_chunk(world, tmp_path, capsys, damage):
    store = world.bad_store(tmp_path / "store", damage)
    code, result, err = cli(capsys, "replay", "--blend-delimiter", " # # ", "--prompt", TEXT + " # # " + QUESTION,
                            "--store", store, "--compare", *model_args(world))
    assert code == 0, err
    assert [s["cached_tokens"] for s in result["segments"]] == [BAD * CHUNK]
    assert math.isfinite(result["blend"]["kl_mean"]) and math.isfinite(result["naive"]["kl_mean"]), result


@pytest.mark.parametrize("damage", DAMAGES)
def test_the_prefix_api_stops_before_the_chunk(world, tmp_path, damage):
    """`get_prefix` (tensors) and `load_prefix` (an engine's paged buffers): each refuses the
    object (and removes it: it is put back for the second) and hands over chunk 0 alone."""
    from kvtool.connectors import ConnectorTarget, PagedMemConnectorV2

    store = world.bad_store(tmp_path / "store", damage)
    layers, heads, head_dim = world.identity.num_layers, world.identity.num_kv_heads, world.identity.head_dim
    with open_store(store) as opened:
        cache = opened.for_model(world.identity, chunk_size=CHUNK)
        name = cache.chunk_names(world.tokens)[BAD]
        damaged = bytes(cache.backend.get(name))
        hit = cache.get_prefix(world.tokens)
        assert hit.num_tokens == BAD * CHUNK and len(hit.refused) == 1 and name in hit.refused[0], hit.refused
        assert torch.equal(hit.kv(), world.kv[:, :, :BAD * CHUNK])

        cache.backend.put(name, damaged, replace=True)
        buffers = [torch.zeros(2, 16, 4, heads, head_dim, dtype=world.kv.dtype) for _ in range(layers)]
        connector = PagedMemConnectorV2(heads * head_dim, layers, layout="flash_attn", num_kv_heads=heads,
                                        head_dim=head_dim)
        target = ConnectorTarget(connector, kvcaches=buffers, slot_mapping=torch.arange(len(world.tokens)))
        hit = cache.load_prefix(world.tokens, target)
        assert hit.num_tokens == BAD * CHUNK and hit.refused
        # the loaded slots hold chunk 0 as stored; a refused chunk's slots (past the loaded prefix:
        # its bytes are checked as they are copied) are the engine's to compute again
        loaded = torch.stack([b.flatten(1, 2)[:, :BAD * CHUNK].flatten(2) for b in buffers], dim=1)  # [2, L, 8, C]
        assert torch.equal(loaded, world.kv[:, :, :BAD * CHUNK])
        assert not cache.backend.exists(name)  # refused, removed


@pytest.mark.parametrize("damage", DAMAGES)
def test_hf_to_cache_of_the_store_stops_before_the_chunk(world, hf_model, tmp_path, damage):
    import kvtool.hf

    store = world.bad_store(tmp_path / "store", damage)
    cache, input_ids = kvtool.hf.to_cache(store, hf_model, prompt_ids=world.tokens, chunk_size=CHUNK)
    assert cache.get_seq_length() == BAD * CHUNK and input_ids.shape == (1, len(world.tokens))
    assert all(bool(torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()) for layer in cache.layers)
