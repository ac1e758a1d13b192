"""`--device`: where capture and replay run the model, and decoding onto a device.

The CPU half runs everywhere: device parsing and its errors, the CLI's one-line
refusals, the device recorded in files and reports, `read_chunk(device=)` and
`ChunkSource.decode_many`.
The GPU half (skipped without CUDA, run by scripts/gpu_check.sh) runs the real
default model on the GPU: capture's KV against the CPU capture, CacheGen chunks
decoded on the GPU against the CPU decoder bit for bit, and replay on the GPU.
"""

from __future__ import annotations


import pytest
import torch

from kvtool.chunk_source import ChunkSource
from kvtool.cli.app import run
from kvtool.devices import describe, resolve_device
from kvtool.errors import UsageError
from kvtool.format import ContainerReader

from fixtures import cli, kv_relative_error, write_kv_file

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (GPU tests: scripts/gpu_check.sh)")
PROMPT = ("A paged KV cache keeps each sequence's keys and values in fixed-size blocks, so that "
          "requests sharing a prefix can share its blocks. ") * 4




# ---- parsing -----------------------------------------------------------------------------------

def test_cpu_spellings():
    for spec in ("cpu", "CPU", " cpu "):
        assert resolve_device(spec) == torch.device("cpu")


def test_auto_takes_the_gpu_only_when_there_is_one():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device(None) == resolve_device("auto")


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "cuda:", "cuda:x", "auto:1", "cuda:0:1", "", "mps"])
def test_bad_device_names_are_usage_errors(spec):
    with pytest.raises(UsageError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA message")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_without_cuda_says_why(spec):
    with pytest.raises(UsageError, match="no CUDA here"):
        resolve_device(spec)


@needs_gpu
def test_cuda_index_beyond_the_machine():
    with pytest.raises(UsageError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


# ---- the CLI refuses in one line ----------------------------------------------------------------

@pytest.mark.parametrize("command", ["capture", "replay", "verify"])
def test_cli_bad_device_is_one_line_exit_2(tmp_path, capsys, command):
    kvc = write_kv_file(tmp_path / "f.kvc").path
    args = {"capture": ["capture", "--prompt", "hi", "-o", tmp_path / "o.kvc"],
            "replay": ["replay", kvc], "verify": ["verify", kvc, "--replay"]}[command]
    code, out, err = cli(capsys, *args, "--device", "tpu")
    assert code == 2 and err.startswith("kvtool: error: ") and err.count("\n") == 1, err
    assert "--device 'tpu'" in err and "Traceback" not in err
    code, out, err = cli(capsys, *args, "--device", "tpu", "--json")
    assert code == 2 and out["ok"] is False and "--device" in out["error"]["message"]
    assert not (tmp_path / "o.kvc").exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA path")
def test_cli_cuda_on_a_cpu_machine_is_refused_before_any_work(tmp_path, capsys):
    code, _, err = cli(capsys, "capture", "--prompt", "hi", "-o", tmp_path / "o.kvc", "--device", "cuda")
    assert code == 2 and err.startswith("kvtool: error: --device cuda: no CUDA here (") and err.count("\n") == 1
    assert not (tmp_path / "o.kvc").exists()


# ---- decoding onto a device ---------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["raw", "zstd", "cachegen"])
def test_read_chunk_on_the_cpu_device_is_read_chunk(tmp_path, codec):
    f = write_kv_file(tmp_path / "f.kvc", num_tokens=40, chunk_size=16, codec=codec)
    with ContainerReader(f.path) as r:
        for i in range(len(r.chunks)):
            a, b = r.read_chunk(i), r.read_chunk(i, device="cpu")
            assert a.device.type == b.device.type == "cpu"
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def decode_many(reader, indices, device="cpu"):
    """The reader's chunk sources of `indices`, decoded together (a batch on a GPU), released."""
    sources = [reader.source(i) for i in indices]
    try:
        return ChunkSource.decode_many(sources, device)
    finally:
        for source in sources:
            source.release()


def test_decode_many_is_read_chunk_of_each(tmp_path):
    f = write_kv_file(tmp_path / "f.kvc", num_tokens=40, chunk_size=8,
                      codecs_per_chunk=[("cachegen", None), ("raw", None), ("zstd", None), ("cachegen", None),
                                        ("cachegen", None)])
    with ContainerReader(f.path) as r:
        for picks in ([0, 1, 2, 3, 4], [3, 4], [4, 0], []):
            got = decode_many(r, picks)
            assert len(got) == len(picks)
            for i, t in zip(picks, got):
                assert torch.equal(t.view(torch.int16), r.read_chunk(i).view(torch.int16))


@needs_gpu
def test_decode_many_on_the_gpu_decodes_a_batch_like_the_cpu(tmp_path):
    f = write_kv_file(tmp_path / "f.kvc", num_tokens=100, chunk_size=16, codec="cachegen")
    with ContainerReader(f.path) as r:
        idx = list(range(len(r.chunks)))
        for cpu, gpu in zip([r.read_chunk(i) for i in idx], decode_many(r, idx, device="cuda")):
            assert gpu.is_cuda and torch.equal(cpu.view(torch.int16), gpu.cpu().view(torch.int16))


def _file_with_a_corrupt_chunk(tmp_path, bad_index=2):
    """A cachegen file whose chunk `bad_index` has a valid CRC over an undecodable payload."""
    from kvtool.format import ContainerWriter

    f = write_kv_file(tmp_path / "good.kvc", num_tokens=64, chunk_size=16, codec="cachegen")
    path = tmp_path / "bad.kvc"
    with ContainerReader(f.path) as r, ContainerWriter(path, f.identity, f.token_ids, kv_dtype=torch.bfloat16,
                                                       chunk_size=16) as w:
        for c in r.chunks:
            payload = bytearray(r.chunk_payload(c.index))
            if c.index == bad_index:
                payload[-1] ^= 0xFF  # the padding of the last layer: the decoder must refuse it
            w.write_encoded_chunk(bytes(payload), c.codec, c.codec_params)
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_corrupt_chunk_is_named_by_read_chunk_and_decode_many(tmp_path, device):
    from kvtool.errors import DecodeError

    path = _file_with_a_corrupt_chunk(tmp_path)
    with ContainerReader(path) as r:
        with pytest.raises(DecodeError, match=r"^chunk 2: cachegen: layer \d+: "):
            r.read_chunk(2, device=device)
        with pytest.raises(DecodeError, match=r"^chunk 2: "):
            decode_many(r, [0, 1, 2, 3], device=device)
        assert len(decode_many(r, [0, 1, 3], device=device)) == 3


# ---- the model on the CPU, by name --------------------------------------------------------------

@pytest.mark.model
def test_capture_and_replay_record_the_device(tmp_path, capsys, default_model):
    path = tmp_path / "cpu.kvc"
    code, r, _ = cli(capsys, "capture", "--prompt", PROMPT, "-o", path, "--chunk-size", "32",
                     "--device", "cpu", "--json")
    assert code == 0 and r["device"] == "cpu"
    with ContainerReader(path) as reader:
        assert reader.manifest.metadata["device"] == "cpu"
    code, r, _ = cli(capsys, "replay", path, "--continue", "4", "--device", "cpu", "--json")
    assert code == 0 and r["device"] == "cpu" and len(r["continuation_tokens"]) == 4
    code, out, _ = cli(capsys, "capture", "--prompt", "Hello", "-o", tmp_path / "h.kvc", "--device", "cpu")
    assert code == 0 and "prefill on cpu" in out


# ---- the model on the GPU -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_files(tmp_path_factory):
    """The same prompt captured on the CPU (raw) and on the GPU (raw and cachegen)."""
    from conftest import _require_default_model

    _require_default_model()
    d = tmp_path_factory.mktemp("gpu")
    files = {}
    for name, device, codec in (("cpu_raw", "cpu", "raw"), ("gpu_raw", "cuda", "raw"),
                                ("gpu_cachegen", "cuda", "cachegen")):
        files[name] = d / f"{name}.kvc"
        assert run(["capture", "--prompt", PROMPT, "-o", str(files[name]), "--chunk-size", "32",
                    "--codec", codec, "--device", device, "--json"]) == 0
    return files


@needs_gpu
@pytest.mark.model
def test_gpu_capture_matches_the_cpu_capture(gpu_files):
    with ContainerReader(gpu_files["gpu_raw"]) as g:
        assert g.manifest.metadata["device"].startswith("cuda")
    # another matmul order: the two runs agree to bf16 rounding, layer by layer, and are not the same run
    assert 0 < kv_relative_error(gpu_files["gpu_raw"], gpu_files["cpu_raw"]) < 0.02


@needs_gpu
@pytest.mark.model
def test_gpu_capture_in_bf16_arithmetic(gpu_files, tmp_path):
    path = tmp_path / "bf16.kvc"
    assert run(["capture", "--prompt", PROMPT, "-o", str(path), "--chunk-size", "32", "--device", "cuda",
                "--model-dtype", "bf16"]) == 0
    assert kv_relative_error(path, gpu_files["cpu_raw"]) < 0.1


@needs_gpu
@pytest.mark.model
def test_gpu_cachegen_capture_decodes_identically_on_cpu_and_gpu(gpu_files):
    with ContainerReader(gpu_files["gpu_cachegen"]) as r:
        for i in range(len(r.chunks)):
            cpu = r.read_chunk(i)
            gpu = r.read_chunk(i, device="cuda")
            assert gpu.is_cuda and torch.equal(cpu.view(torch.int16), gpu.cpu().view(torch.int16))


@needs_gpu
@pytest.mark.model
def test_gpu_cachegen_capture_is_within_quantisation_error_of_the_raw_one(gpu_files):
    assert kv_relative_error(gpu_files["gpu_cachegen"], gpu_files["gpu_raw"]) < 0.25


@needs_gpu
@pytest.mark.model
def test_gpu_cachegen_capture_writes_the_cpu_coders_bytes(gpu_files, tmp_path):
    """Capture encodes on the GPU; compressing the raw GPU capture on the CPU must give the
    same payloads. First the coder on the real KV of every chunk; then, when two GPU prefills
    agree bit for bit, the capture command itself."""
    from kvtool.codecs.cachegen import cachegen_encode
    from kvtool.codecs.cachegen import gpu as gpu_cachegen

    with ContainerReader(gpu_files["gpu_raw"]) as r:
        for i in range(len(r.chunks)):
            kv = r.read_chunk(i)
            assert gpu_cachegen.encode(kv.cuda(), None)[0] == cachegen_encode(kv, None)[0], f"chunk {i}"
    again = tmp_path / "again.kvc"
    assert run(["capture", "--prompt", PROMPT, "-o", str(again), "--chunk-size", "32", "--device", "cuda"]) == 0
    with ContainerReader(gpu_files["gpu_raw"]) as a, ContainerReader(again) as b:
        same = all(bytes(a.chunk_payload(i)) == bytes(b.chunk_payload(i)) for i in range(len(a.chunks)))
    if not same:
        pytest.skip("two GPU prefills of the same prompt differ in the last bits here")
    cpu_made = tmp_path / "cpu_cachegen.kvc"
    assert run(["compress", str(gpu_files["gpu_raw"]), "-o", str(cpu_made), "--codec", "cachegen"]) == 0
    with ContainerReader(cpu_made) as c, ContainerReader(gpu_files["gpu_cachegen"]) as g:
        assert len(c.chunks) == len(g.chunks)
        for i in range(len(c.chunks)):
            assert bytes(c.chunk_payload(i)) == bytes(g.chunk_payload(i)), f"chunk {i}"


@needs_gpu
@pytest.mark.model
def test_gpu_replay_of_a_gpu_made_lossless_file_reproduces_the_recompute(gpu_files, capsys):
    code, r, _ = cli(capsys, "replay", gpu_files["gpu_raw"], "--compare", "--continue", "12", "--device", "cuda",
                     "--json")
    assert code == 0 and r["device"].startswith("cuda")
    assert r["top1_agreement"] == 1.0 and r["greedy_identical_tokens"] == 12
    assert r["kl_mean"] < 1e-3  # the last token is computed alone: another kernel shape, float noise


@needs_gpu
@pytest.mark.model
def test_gpu_replay_of_a_cpu_made_lossless_file(gpu_files, capsys):
    code, r, _ = cli(capsys, "replay", gpu_files["cpu_raw"], "--compare", "--continue", "8", "--device", "cuda",
                     "--json")
    assert code == 0 and r["top1_agreement"] >= 0.875 and r["kl_mean"] < 1e-2  # CPU-vs-GPU arithmetic only


@needs_gpu
@pytest.mark.model
def test_gpu_replay_of_a_cachegen_file(gpu_files, capsys):
    code, r, _ = cli(capsys, "replay", gpu_files["gpu_cachegen"], "--compare", "--continue", "8",
                     "--device", "cuda", "--json")
    assert code == 0 and r["reused_tokens"] == r["num_tokens"] - 1
    assert r["top1_agreement"] >= 0.5


@needs_gpu
@pytest.mark.model
def test_gpu_capture_goes_through_the_fused_kernel_and_the_gpu_coder(tmp_path, monkeypatch):
    from conftest import _require_default_model
    from kvtool.codecs.cachegen import gpu as gpu_cachegen
    from kvtool.connectors import paged_cuda as paged

    _require_default_model()
    calls = {"gather": 0, "encode": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(paged, "gather", counting("gather", paged.gather))
    monkeypatch.setattr(gpu_cachegen, "encode_chunks", counting("encode", gpu_cachegen.encode_chunks))
    assert run(["capture", "--prompt", PROMPT, "-o", str(tmp_path / "c.kvc"), "--chunk-size", "32",
                "--codec", "cachegen", "--device", "cuda"]) == 0
    with ContainerReader(tmp_path / "c.kvc") as r:
        assert calls["gather"] == calls["encode"] == len(r.chunks) > 1
    assert describe(torch.device("cuda", 0)).startswith("cuda:0 (")
