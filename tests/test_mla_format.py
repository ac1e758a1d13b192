"""The mla_latent layout kind (format-spec/container.md 3.2, version 1.1): one latent per token and
layer, written, read, inspected, verified, dumped and recompressed bit for bit; refused where the
spec says, in one line; the committed vectors read by a reader written from the spec alone."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import cli, pack_header, put, rebuild, split_file
from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity
from kvtool.identity import model_fingerprint

VECTORS_DIR = Path(__file__).resolve().parents[1] / "format-spec" / "vectors"
_spec = importlib.util.spec_from_file_location("make_mla_vectors", VECTORS_DIR / "make_mla_vectors.py")
make_mla_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_mla_vectors)

RANK, ROPE, LAYERS = 512, 64, 2


def mla_identity(**extra) -> ModelIdentity:
    return ModelIdentity(name="tiny-mla", architecture="DeepseekV3ForCausalLM", num_layers=LAYERS,
                         num_attention_heads=4, num_kv_heads=1, head_dim=RANK + ROPE, hidden_size=128,
                         intermediate_size=256, vocab_size=1000, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope={"rope_theta": 10000.0, "rope_scaling": None},
                         extra={"kv_layout": "mla_latent", "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, **extra})


def latent(tokens: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, LAYERS, tokens, RANK + ROPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def write_mla(path: Path, tokens: int = 40, codec: str = "zstd", chunk_size: int = 16) -> torch.Tensor:
    kv = latent(tokens)
    with ContainerWriter(path, mla_identity(), list(range(100, 100 + tokens)), kv_dtype=torch.bfloat16,
                         chunk_size=chunk_size) as writer:
        for start, end in writer.chunk_ranges():
            writer.write_chunk(kv[:, :, start:end], codec=codec)
    return kv


@pytest.fixture
def mla_file(tmp_path) -> tuple[Path, torch.Tensor]:
    path = tmp_path / "mla.kvc"
    return path, write_mla(path)


def test_an_mla_file_is_version_1_1_and_reads_back_bit_exact(mla_file, tmp_path):
    path, kv = mla_file
    with ContainerReader(path) as reader:
        assert reader.version == "1.1"
        assert (reader.manifest.kv_layout, reader.manifest.latent) == ("mla_latent", {"kv_lora_rank": RANK,
                                                                                       "rope_dim": ROPE})
        assert [c.shape for c in reader.chunks] == [(1, LAYERS, 16, 576), (1, LAYERS, 16, 576), (1, LAYERS, 8, 576)]
        assert torch.equal(reader.read_range(0, reader.num_tokens), kv)
    kv_blob = tmp_path / "kv.kvc"  # a K/V file is still a 1.0 file: older readers read it as before
    from fixtures import write_kv_file

    write_kv_file(kv_blob)
    with ContainerReader(kv_blob) as reader:
        assert reader.version == "1.0" and reader.manifest.kv_layout == "kv_blob"
        assert "latent" not in split_file(kv_blob).manifest["kv"]


def test_the_layout_is_in_the_fingerprint():
    """An MLA model's identity names its layout: its chunks can never be another model's."""
    plain = mla_identity().to_dict()
    del plain["extra"]
    assert mla_identity().fingerprint() != model_fingerprint(plain)
    assert mla_identity().fingerprint() != mla_identity(kv_lora_rank=256).fingerprint()


def test_inspect_verify_dump_and_compress_an_mla_file(mla_file, tmp_path, capsys):
    path, kv = mla_file
    code, summary, _ = cli(capsys, "inspect", path, "--stats", "--json")
    assert code == 0 and summary["kv_layout"] == "mla_latent" and summary["format_version"] == "1.1"
    assert summary["latent"] == {"kv_lora_rank": RANK, "rope_dim": ROPE}
    assert {s["kind"] for s in summary["stats"]} == {"latent"} and len(summary["stats"]) == LAYERS
    assert summary["totals"]["decoded_bytes"] == kv.numel() * 2
    code, out, _ = cli(capsys, "inspect", path)
    assert code == 0 and "layout mla_latent: kv_lora_rank 512 + rope_dim 64" in out
    code, report, _ = cli(capsys, "verify", path, "--json")
    assert code == 0 and report["ok"] is True

    # compress: zstd -> raw -> zstd, every step bit exact, and verify --against finds no difference
    raw, again = tmp_path / "raw.kvc", tmp_path / "again.kvc"
    assert cli(capsys, "compress", path, "-o", raw, "--codec", "raw")[0] == 0
    assert cli(capsys, "compress", raw, "-o", again, "--codec", "zstd")[0] == 0
    for name in (raw, again):
        with ContainerReader(name) as reader:
            assert reader.version == "1.1" and {c.codec for c in reader.chunks} == {raw.stem if name == raw else "zstd"}
            assert torch.equal(reader.read_range(0, reader.num_tokens), kv)
    code, report, _ = cli(capsys, "verify", again, "--against", path, "--json")
    assert code == 0 and report["comparison"]["max_abs"] == 0
    assert {layer["kind"] for layer in report["comparison"]["layers"]} == {"L"}

    # dump: one latent a layer, its split point in the metadata
    from safetensors import safe_open

    out = tmp_path / "mla.safetensors"
    assert cli(capsys, "dump", path, "-o", out)[0] == 0
    with safe_open(str(out), "pt") as f:
        assert sorted(k for k in f.keys() if k.startswith("layers.")) == ["layers.0.latent", "layers.1.latent"]
        for layer in range(LAYERS):
            assert torch.equal(f.get_tensor(f"layers.{layer}.latent"), kv[0, layer])
        assert f.metadata()["kv_layout"] == "mla_latent"
        assert (f.metadata()["kv_lora_rank"], f.metadata()["rope_dim"]) == ("512", "64")
    npy = tmp_path / "mla.npy"
    assert cli(capsys, "dump", path, "-o", npy)[0] == 0
    assert np.array_equal(np.load(npy), kv.float().numpy())
    assert json.loads(Path(f"{npy}.json").read_text())["kv_layout"] == "mla_latent"


@pytest.mark.parametrize("codec", ["cachegen", "pca"])
def test_lossy_codecs_refuse_a_latent_in_one_line(mla_file, tmp_path, capsys, codec):
    path, _ = mla_file
    code, _, err = cli(capsys, "compress", path, "-o", tmp_path / "out.kvc", "--codec", codec)
    assert code == 2 and not (tmp_path / "out.kvc").exists()
    assert err.strip().count("\n") == 0 and "not the mla_latent layout's latent" in err and "Traceback" not in err


def _refused(tmp_path, capsys, data: bytes) -> str:
    code, _, err = cli(capsys, "inspect", put(tmp_path, data))
    assert code == 2 and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


def test_a_layout_kind_this_reader_does_not_know_is_refused_naming_the_version(mla_file, tmp_path, capsys):
    path, _ = mla_file
    future = rebuild(path, lambda doc: doc["kv"].update(layout="state_snapshot"),
                     header=pack_header(minor=2, alignment=4096))
    err = _refused(tmp_path, capsys, future)
    assert "kv.layout 'state_snapshot' is not a layout kind of format version 1.1" in err
    assert "the file is version 1.2" in err


@pytest.mark.parametrize("case, words", [
    ("version 1.0", "needs format version 1.1; the file says 1.0"),
    ("no latent", "lacks the required key 'latent'"),
    ("latent of a K/V file", "kv.latent belongs to the mla_latent layout"),
    ("rank disagrees", "1 KV head of kv_lora_rank + rope_dim = 320 channels, not 1 x 576"),
    ("odd rope", "rope_dim 63 must be even"),
    ("K and V planes", "shape [2, 2, 16, 576] is not [1, 2, 16, 576]"),
    ("cachegen chunk", "coded with 'cachegen', which codes K and V"),
])
def test_an_inconsistent_mla_file_is_refused_in_one_line(mla_file, tmp_path, capsys, case, words):
    path, _ = mla_file
    header = pack_header(minor=1, alignment=4096)
    edits = {
        "version 1.0": lambda d: None,
        "no latent": lambda d: d["kv"].pop("latent"),
        "latent of a K/V file": lambda d: d["kv"].update(layout="kv_blob"),
        "rank disagrees": lambda d: d["kv"]["latent"].update(kv_lora_rank=256),
        "odd rope": lambda d: d["kv"]["latent"].update(rope_dim=63, kv_lora_rank=513),
        "K and V planes": lambda d: d["chunks"][0].update(shape=[2, 2, 16, 576]),
        "cachegen chunk": lambda d: d["chunks"][0].update(codec="cachegen", codec_id=2),
    }
    data = rebuild(path, edits[case], header=pack_header(minor=0, alignment=4096) if case == "version 1.0" else header)
    assert words in _refused(tmp_path, capsys, data)


def test_the_writer_refuses_a_chunk_of_k_and_v_planes(tmp_path):
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match=r"expected \[1, 2, 4, 576\]"):
        with ContainerWriter(tmp_path / "x.kvc", mla_identity(), [1, 2, 3, 4], chunk_size=4) as writer:
            writer.write_chunk(torch.zeros(2, LAYERS, 4, 576, dtype=torch.bfloat16))
    assert not (tmp_path / "x.kvc").exists()


# --- the vectors ----------------------------------------------------------------------------


def spec_only_read(path: Path) -> tuple[dict, bytes]:
    """A reader written from container.md alone (struct, json, hashlib): the manifest, and the
    chunks' raw payload bytes concatenated per layer into the [1, L, T, C] latent."""
    data = path.read_bytes()
    magic, major, minor, size, alignment, flags, _ = struct.unpack_from("<8sHHIII40s", data)
    assert (magic, major, minor, size, flags) == (b"\x89KVC\r\n\x1a\n", 1, 1, 64, 0)
    offset, length, _, _, end = struct.unpack_from("<QQII8s", data, len(data) - 32)
    assert end == b"\x89KVCEND\n" and offset + length + 32 == len(data)
    manifest = json.loads(data[offset:offset + length])
    kv = manifest["kv"]
    assert kv["layout"] == "mla_latent" and manifest["model"]["num_kv_heads"] == 1
    channels = kv["latent"]["kv_lora_rank"] + kv["latent"]["rope_dim"]
    assert manifest["model"]["head_dim"] == channels
    layers, item = manifest["model"]["num_layers"], 2  # bfloat16
    per_layer = [b""] * layers
    previous = bytes(32)
    tokens = struct.unpack_from(f"<{manifest['sequence']['num_tokens']}I", data, manifest["sequence"]["tokens"]["offset"])
    for chunk in manifest["chunks"]:
        previous = hashlib.sha256(previous + struct.pack(f"<{chunk['end'] - chunk['start']}I",
                                                         *tokens[chunk["start"]:chunk["end"]])).digest()
        assert chunk["prefix_hash"] == previous.hex()
        assert chunk["shape"] == [1, layers, chunk["end"] - chunk["start"], channels]
        payload = data[chunk["offset"]:chunk["offset"] + chunk["length"]]
        if chunk["codec"] == "zstd":
            import zstandard

            planes = zstandard.ZstdDecompressor().decompress(payload)
            n = len(planes) // item  # byte-plane shuffle undone (container.md 6.2)
            payload = bytes(planes[(item - 1 - b) * n + e] for e in range(n) for b in range(item))
        row = (chunk["end"] - chunk["start"]) * channels * item
        for layer in range(layers):
            per_layer[layer] += payload[layer * row:(layer + 1) * row]
    return manifest, b"".join(per_layer)


@pytest.mark.parametrize("name", sorted(make_mla_vectors.VECTORS))
def test_a_spec_only_reader_and_kvtool_decode_the_mla_vectors(name):
    path = VECTORS_DIR / f"{name}.kvc"
    expected = (VECTORS_DIR / f"{name}.kv.bin").read_bytes()
    _, decoded = spec_only_read(path)
    assert decoded == expected
    with ContainerReader(path) as reader:
        assert reader.read_range(0, reader.num_tokens).contiguous().view(torch.uint8).numpy().tobytes() == expected
    from kvtool.ops.verify import verify

    assert verify(path).ok


def test_the_mla_vectors_are_what_the_generator_writes_and_kvtool_writes_the_raw_one():
    for name, codec in make_mla_vectors.VECTORS.items():
        if codec == "raw":  # (a zstd frame may differ between zstd library versions)
            assert make_mla_vectors.build(codec) == (VECTORS_DIR / f"{name}.kvc").read_bytes()
    path = VECTORS_DIR / "mla_raw_bf16.kvc"
    with ContainerReader(path) as reader:
        kv, model = reader.read_range(0, reader.num_tokens), dict(reader.manifest.model)
    writer = ContainerWriter(None, model, make_mla_vectors.TOKENS, kv_dtype=torch.bfloat16,
                             chunk_size=make_mla_vectors.CHUNK_SIZE, alignment=64, metadata=make_mla_vectors.METADATA)
    for start, end in writer.chunk_ranges():
        writer.write_chunk(kv[:, :, start:end], "raw")
    writer.finish()
    assert writer.getvalue() == path.read_bytes()


def test_the_mla_vectors_validate_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((VECTORS_DIR.parent / "manifest.schema.json").read_text())
    for name in make_mla_vectors.VECTORS:
        manifest = split_file(VECTORS_DIR / f"{name}.kvc").manifest
        jsonschema.validate(manifest, schema)
        broken = {**manifest, "kv": {"dtype": "bfloat16", "layout": "mla_latent"}}  # no latent
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_latent_chunks_load_only_for_their_namespace_salt_adapter_and_layout(tmp_path):
    """The store's isolation holds for latent chunks: another namespace, cache salt or LoRA adapter
    finds none of them, and neither does a K/V model whose other facts are the same."""
    from kvtool.store import open_store
    from kvtool.store.names import ExtraKeys

    ids, kv = list(range(500, 548)), latent(48)
    owner = ExtraKeys(namespace="team-a", cache_salt="salt-a", adapter="lora-a")
    with open_store(str(tmp_path / "store")) as store:
        assert store.for_model(mla_identity(), 16, owner).put_sequence(ids, kv).stored == 3
        hit = store.for_model(mla_identity(), 16, owner).get_prefix(ids)
        assert hit.num_tokens == 48 and torch.equal(hit.kv(), kv)
        for other in (ExtraKeys(namespace="team-b", cache_salt="salt-a", adapter="lora-a"),
                      ExtraKeys(namespace="team-a", cache_salt="salt-b", adapter="lora-a"),
                      ExtraKeys(namespace="team-a", cache_salt="salt-a", adapter="lora-b"),
                      ExtraKeys()):
            assert store.for_model(mla_identity(), 16, other).get_prefix(ids).num_tokens == 0
        kv_model = mla_identity().to_dict()
        kv_model["extra"] = {}  # the same facts, K and V: another fingerprint, other names
        kv_model = {**kv_model, "fingerprint": model_fingerprint(kv_model)}
        assert store.for_model(kv_model, 16, owner).get_prefix(ids).num_tokens == 0
