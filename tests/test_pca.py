"""The pca codec (format-spec/pca.md): its reference coder's round trip against the spec's
transform, its parameters, its calibration object, and its refusals of damaged payloads.

The calibration here is fitted on random data of a small geometry (2 layers, 2 KV heads of 8):
the coder's properties do not depend on the model; tests/test_pca_model.py runs the real one."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

import kvtool

from kvtool.codecs import get_codec
from kvtool.codecs.pca import QUALITY, QUALITY_BY_AXES, PcaCodec, params_for
from kvtool.codecs.pca import calibration as calmod
from kvtool.codecs.pca import reference as ref
from kvtool.codecs.pca.fit import Moments, fit
from kvtool.errors import CodecParamsInvalid, DecodeError, NonFiniteValues

L, H, D = 2, 2, 8
C = H * D


def small_calibration(seed: int = 0) -> calmod.Calibration:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(L, C, C, generator=g) * torch.linspace(2.0, 0.05, C)  # a few strong directions
    moments = []
    for _ in range(2):
        m = Moments(L, C)
        m.add(torch.randn(L, 400, C, generator=g) @ mix + 0.3)
        moments.append(m)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2) / D))).repeat(L, 1)
    metric = torch.rand(2, L, C, generator=g) + 0.5
    return fit(moments[0], moments[1], metric[0], metric[1], inv_freq, D, "sha256:" + "0" * 64)


@pytest.fixture()
def cal(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_DIR", str(tmp_path / "cal"))
    monkeypatch.delenv("KVTOOL_CALIBRATION_PATH", raising=False)
    calmod._loaded.clear()
    saved = small_calibration().save(tmp_path / "cal")
    yield saved
    calmod._loaded.clear()


def sample_kv(tokens: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, L, tokens, C, generator=g) * 2 + 0.3).to(dtype)


def expected(kv: torch.Tensor, cal, step: float, sinks: int, position: int) -> torch.Tensor:
    """The spec's reconstruction (§5), written out: sinks exact, the rest forward then inverse."""
    x = kv.float().numpy()
    s = min(kv.shape[2], max(0, sinks - position))
    out = kv.clone()
    if s < kv.shape[2]:
        q = ref.forward(x[:, :, s:], cal, position + s, step)
        out[:, :, s:] = torch.from_numpy(ref.inverse(q, cal, position + s, step)).to(kv.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("position", [0, 2, 256])
def test_round_trip_is_the_spec_transform(cal, dtype, position):
    codec = get_codec("pca")
    kv = sample_kv(37, dtype=dtype)
    params = dict(params_for(cal.digest, "97"), position=position)
    payload, recorded = codec.encode(kv, params)
    out = codec.decode(memoryview(payload), tuple(kv.shape), dtype, recorded)
    assert torch.equal(out, expected(kv, cal, recorded["step"], 4, position))
    if position < 4:
        assert torch.equal(out[:, :, :4 - position], kv[:, :, :4 - position])  # sinks kept exact
    err = (out.float() - kv.float()).pow(2).mean().sqrt()
    assert 0 < err < 0.5 * kv.float().std()


def test_finer_steps_cost_more_and_err_less(cal):
    codec = get_codec("pca")
    kv = sample_kv(64)
    sizes, errors = [], []
    for quality in ("89", "95", "97", "99"):
        payload, p = codec.encode(kv, params_for(cal.digest, quality))
        out = codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, p)
        sizes.append(len(payload))
        errors.append(float((out.float() - kv.float()).pow(2).mean()))
    assert sizes == sorted(sizes) and errors == sorted(errors, reverse=True)


def test_a_zero_chunk_and_a_chunk_of_sinks_only(cal):
    codec = get_codec("pca")
    mean = torch.from_numpy(cal.mean)  # [2, L, C]: at the mean (V) every coefficient is 0
    kv = mean[:, :, None, :].expand(2, L, 9, C).to(torch.float32).contiguous()
    payload, p = codec.encode(kv, dict(params_for(cal.digest, "97"), position=10, sinks=0))
    out = codec.decode(memoryview(payload), tuple(kv.shape), kv.dtype, p)
    assert torch.allclose(out[1], kv[1], atol=1e-5)
    short = sample_kv(3)
    payload, p = codec.encode(short, params_for(cal.digest, "97"))
    assert torch.equal(codec.decode(memoryview(payload), tuple(short.shape), short.dtype, p), short)


def test_the_payload_is_deterministic_and_the_reader_checks_its_lengths(cal):
    codec = get_codec("pca")
    kv = sample_kv(40)
    params = params_for(cal.digest, "95")
    a, p = codec.encode(kv, params)
    b, _ = codec.encode(kv.clone(), params)
    assert a == b
    for cut in (0, 10, len(a) // 2, len(a) - 1):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(a[:cut]), tuple(kv.shape), kv.dtype, p)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(a + b"\0\0\0\0"), tuple(kv.shape), kv.dtype, p)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(a), (2, L, 41, C), kv.dtype, p)  # another shape


def test_flipped_bytes_never_crash(cal):
    codec = get_codec("pca")
    kv = sample_kv(48)
    payload, p = codec.encode(kv, params_for(cal.digest, "89"))
    rng = np.random.default_rng(5)
    refused = 0
    for _ in range(150):
        damaged = bytearray(payload)
        for i in rng.integers(0, len(damaged), size=int(rng.integers(1, 4))):
            damaged[i] ^= 1 << int(rng.integers(0, 8))
        try:
            out = codec.decode(memoryview(bytes(damaged)), tuple(kv.shape), kv.dtype, p)
            assert out.shape == kv.shape
        except DecodeError:
            refused += 1
    assert refused > 50  # most damage is seen (the rANS end state, the counts, the lengths)


def test_a_side_byte_with_shift_seven_is_refused(cal):
    codec = get_codec("pca")
    kv = sample_kv(20)
    payload, p = codec.encode(kv, params_for(cal.digest, "97"))
    lanes, sinks, entries, sink_at, rows_at = ref.parse(payload, tuple(kv.shape), "bfloat16")
    damaged = bytearray(payload)
    damaged[rows_at] = 7 << 5
    with pytest.raises(DecodeError, match="shift 7"):
        codec.decode(memoryview(bytes(damaged)), tuple(kv.shape), kv.dtype, p)


def test_non_finite_input_is_refused(cal):
    kv = sample_kv(8)
    kv[1, 0, 5, 3] = float("nan")
    with pytest.raises(NonFiniteValues):
        get_codec("pca").encode(kv, params_for(cal.digest, "97"))


@pytest.mark.parametrize("bad, match", [
    ({"calibration": "abc"}, "SHA-256"),
    ({"step": 0.0}, "step"),
    ({"step": float("inf")}, "step"),
    ({"step": True}, "step"),
    ({"sinks": -1}, "sinks"),
    ({"lanes": 65}, "lanes"),
    ({"position": 1.5}, "position"),
    ({"quality": "98"}, "quality"),
    ({"colour": 1}, "unknown"),
    ({"version": 3}, "version"),
    ({"version": 2}, "lanes"),  # version 2 codes in units, not lanes (format-spec/pca.md §11)
])
def test_bad_parameters_are_one_named_error(bad, match):
    good = {"version": 1, "calibration": "a" * 64, "quality": "97", "step": 0.9, "sinks": 4, "lanes": 16, "position": 0}
    params = dict(good, **bad)
    with pytest.raises(CodecParamsInvalid, match=match):
        PcaCodec().validate_params(params)


def test_parameters_without_a_step_are_refused():
    """pca.md §2: `step` is REQUIRED, with or without a `quality`; a quality is a JSON string."""
    good = {"version": 1, "calibration": "a" * 64, "quality": "97", "step": 0.9, "sinks": 4, "lanes": 16, "position": 0}
    for params in ({k: v for k, v in good.items() if k != "step"},
                   {k: v for k, v in good.items() if k not in ("step", "quality")}):
        with pytest.raises(CodecParamsInvalid, match="'step' is required"):
            PcaCodec().validate_params(params)
    with pytest.raises(CodecParamsInvalid, match="quality"):
        PcaCodec().validate_params(dict(good, quality=97))


def test_a_constant_chunk_expands_past_1024x_and_is_written_and_read(tmp_path, monkeypatch):
    """pca.md §8, container.md §5: a chunk whose every coefficient is zero is a few bytes per row
    and channel (here 1,208 bytes for 8 MiB of KV, 6,944x); the container's 1024x does not bound pca,
    tokens x itemsize does. Before, the writer refused this file (ManifestInvalid, 'beyond the
    format's limit') and a reader would have too."""
    from fixtures import make_identity, read_everything, write_kv_file

    identity = make_identity(num_layers=1, num_kv_heads=4, head_dim=128)
    Cw, Dw = 512, 128
    big = calmod.Calibration(mean=np.zeros((2, 1, Cw), np.float32), weight=np.ones((2, 1, Cw), np.float32),
                             basis=np.broadcast_to(np.eye(Cw, dtype=np.int16) * calmod.BASIS_ONE, (2, 1, Cw, Cw)).copy(),
                             inv_freq=(1.0 / 10000 ** (np.arange(0, Dw, 2) / Dw)).astype(np.float32)[None],
                             head_dim=Dw, model="constant").save(tmp_path)
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(tmp_path))
    calmod._loaded.clear()
    T = 4096
    kv = torch.zeros(2, 1, T, Cw, dtype=torch.bfloat16)
    params = {"version": 1, "calibration": big.digest, "step": 1.0, "sinks": 0, "lanes": 16, "position": 0}
    f = write_kv_file(tmp_path / "c.kvc", identity=identity, num_tokens=T, chunk_size=T, codec="pca",
                      params=params, kv=kv)
    got = read_everything(f.path)
    with kvtool.open(f.path) as reader:
        (chunk,) = reader.chunks
        assert chunk.blob.length * 1024 + (1 << 20) < chunk.decoded_bytes < chunk.blob.length * T * 2
        assert torch.equal(reader.read_chunk(0), kv)
    assert got is not None
    calmod._loaded.clear()


def test_the_search_order_is_the_spec_s(cal, tmp_path, monkeypatch):
    """pca.md §3.1: $KVTOOL_CALIBRATION_PATH's folders in order, then $KVTOOL_CALIBRATION_DIR; the
    first file found is read, and one whose bytes hash otherwise is refused, not skipped; a miss
    names every place looked; `model` in the metadata is not checked against anything."""
    name = f"{cal.digest}.kvcal"
    good = (tmp_path / "cal" / name).read_bytes()
    first, second = tmp_path / "p1", tmp_path / "p2"
    second.mkdir()
    (second / name).write_bytes(good)
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", os.pathsep.join([str(first), "", str(second)]))
    assert calmod.search_path() == [first, second, tmp_path / "cal"]
    calmod._loaded.clear()
    assert calmod.find(cal.digest).digest == cal.digest  # from p2 (p1 has none)
    first.mkdir()
    (first / name).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # p1 now holds damaged bytes
    calmod._loaded.clear()
    with pytest.raises(DecodeError, match="hash"):
        calmod.find(cal.digest)
    for folder in (first, second, tmp_path / "cal"):
        (folder / name).unlink()
    calmod._loaded.clear()
    with pytest.raises(calmod.CalibrationNotFound) as err:
        calmod.find(cal.digest)
    assert all(str(f) in str(err.value) for f in (first, second, tmp_path / "cal"))
    assert cal.model != "any model" and calmod.from_bytes(good, cal.digest).model == cal.model


def test_no_default_parameters_without_a_calibration():
    with pytest.raises(CodecParamsInvalid, match="calibration"):
        PcaCodec().default_params()


def test_a_missing_calibration_is_one_line(cal, tmp_path):
    kv = sample_kv(8)
    payload, p = get_codec("pca").encode(kv, params_for(cal.digest, "97"))
    calmod._loaded.clear()
    (tmp_path / "cal" / f"{cal.digest}.kvcal").unlink()
    with pytest.raises(calmod.CalibrationNotFound) as err:
        get_codec("pca").decode(memoryview(payload), tuple(kv.shape), kv.dtype, p)
    assert cal.digest[:16] in str(err.value) and "\n" not in str(err.value)


def test_a_calibration_whose_bytes_do_not_match_its_name_is_refused(cal, tmp_path):
    path = tmp_path / "cal" / f"{cal.digest}.kvcal"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    calmod._loaded.clear()
    with pytest.raises(DecodeError, match="hash"):
        calmod.find(cal.digest)


def test_the_calibration_file_is_named_by_its_digest_and_round_trips(cal, tmp_path):
    path = tmp_path / "cal" / f"{cal.digest}.kvcal"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == cal.digest
    back = calmod.from_bytes(path.read_bytes(), cal.digest)
    for name in ("mean", "weight", "basis", "inv_freq"):
        assert np.array_equal(getattr(back, name), getattr(cal, name))
    # the basis is orthonormal within its Q14 rounding
    b = back.basis[0, 0].astype(np.float64) / calmod.BASIS_ONE
    assert np.abs(b.T @ b - np.eye(C)).max() < 1e-3


def test_a_calibration_for_another_geometry_is_refused(cal):
    kv = torch.zeros(2, L, 4, 2 * C, dtype=torch.bfloat16)
    with pytest.raises(DecodeError, match="calibration is for"):
        get_codec("pca").decode(memoryview(b"KVPC"), tuple(kv.shape), kv.dtype, params_for(cal.digest, "97"))


def test_the_model_index_gives_the_default_calibration(cal):
    assert calmod.for_model("sha256:" + "1" * 64) is None
    calmod.register("sha256:" + "1" * 64, cal.digest)
    assert calmod.for_model("sha256:" + "1" * 64) == cal.digest


def test_tables_are_what_the_spec_says():
    assert ref.FREQ.shape == (32, 16) and (ref.FREQ.sum(1) == 4096).all() and ref.FREQ.min() >= 1
    cost = np.rint(-np.log2(ref.FREQ / 4096) * 256)
    assert np.array_equal(cost, ref.COST)
    assert set(QUALITY) == {"99", "97", "95", "89"}
    assert all(list(table) == list(QUALITY) for table in QUALITY_BY_AXES.values())


def test_the_step_of_a_quality_is_its_calibrations(cal):
    """A calibration learned per KV head takes the steps bench_rd measured for that kind (§34),
    one learned per layer the others (§32); the object must be here to know which."""
    from kvtool.codecs.pca import calibration as calmod

    layer = calmod.remember(calmod.Calibration(**{**cal.__dict__, "digest": ""}))
    C, D = layer.channels, layer.head_dim
    heads = np.arange(C) // D
    basis = layer.basis.copy()
    basis[..., heads[:, None] != heads[None, :]] = 0
    head = calmod.remember(calmod.Calibration(**{**cal.__dict__, "basis": basis, "digest": ""}))
    assert calmod.axes(layer) == "layer" and calmod.axes(head) == "head"
    for q in QUALITY:
        assert params_for(layer.digest, q)["step"] == QUALITY_BY_AXES["layer"][q][0]
        assert params_for(head.digest, q)["step"] == QUALITY_BY_AXES["head"][q][0]
    with pytest.raises(calmod.CalibrationNotFound):
        params_for("b" * 64, "97")
    # one KV head: the two kinds are one; the default's table
    one = calmod.Calibration(**{**cal.__dict__, "basis": cal.basis[:, :, :D, :D].copy(), "mean": cal.mean[..., :D].copy(),
                                "weight": cal.weight[..., :D].copy(), "digest": ""})
    assert calmod.axes(one) == "layer"
    # a quality without a step (hand-made parameters): refused (pca.md §2), since a name's step
    # depends on the calibration: before, the per-layer step was taken and a per-head writer's chunk
    # decoded to other values without an error
    with pytest.raises(CodecParamsInvalid, match="'step' is required"):
        PcaCodec().validate_params({"version": 1, "calibration": "c" * 64, "quality": "97"})


def test_payload_stats_account_for_every_byte(cal):
    codec = get_codec("pca")
    kv = sample_kv(50)
    payload, p = codec.encode(kv, params_for(cal.digest, "95"))
    stats = codec.payload_stats(memoryview(payload), tuple(kv.shape), p)
    parts = stats["bits_per_value_by_part"]
    assert abs(sum(parts.values()) - stats["bits_per_value"]) < 1e-9
    assert min(parts.values()) >= 0 and parts["rans"] > 0 and parts["sinks"] > 0
    assert 0 < stats["components_coded"] <= stats["components"] == 2 * L * C


def golden_calibration() -> calmod.Calibration:
    """A calibration of exact numbers (no fit, no BLAS): a 16 x 16 Hadamard basis (entries +-1/4,
    exactly 4096 in Q14), simple means and weights, power-of-two frequencies."""
    h = np.array([[1]], dtype=np.int64)
    while h.shape[0] < C:
        h = np.block([[h, h], [h, -h]])
    basis = np.broadcast_to((h * 4096).astype(np.int16), (2, L, C, C)).copy()
    mean = (np.arange(2 * L * C, dtype=np.float32).reshape(2, L, C) % 5 - 2) / 8
    weight = 1 + (np.arange(2 * L * C, dtype=np.float32).reshape(2, L, C) % 3) / 4
    inv_freq = np.broadcast_to(2.0 ** -np.arange(D // 2, dtype=np.float32), (L, D // 2)).copy()
    return calmod.Calibration(mean=mean, weight=weight.astype(np.float32), basis=basis, inv_freq=inv_freq,
                              head_dim=D, model="sha256:" + "0" * 64)


# The payload of golden_kv() coded with golden_calibration() at step 0.5 from position 2: a change
# of these bytes is a change of the bitstream (format-spec/pca.md), never a refactoring.
GOLDEN_SHA256 = "4e133fd3211507bb36fe3964716d3e43b39caeb3f9f2659208ae7332a9dd07b2"


def golden_kv() -> torch.Tensor:
    i = torch.arange(2 * L * 24 * C, dtype=torch.float32).view(2, L, 24, C)
    return (torch.sin(i * 0.37) * 3 + torch.cos(i * 0.011) * (i % 7 - 3)).to(torch.bfloat16)


def test_the_golden_payload(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CALIBRATION_PATH", str(tmp_path))
    calmod._loaded.clear()
    cal = golden_calibration().save(tmp_path)
    kv = golden_kv()
    params = dict(params_for(cal.digest, "97"), step=0.5, position=2)
    payload, p = get_codec("pca").encode(kv, params)
    raw = kv.view(torch.int16).numpy().view(np.uint16)
    assert payload == ref.encode_chunk(raw, "bfloat16", cal, 0.5, 4, 2, 16)  # whichever coder ran
    digest = hashlib.sha256(payload).hexdigest()
    print("golden pca payload:", len(payload), digest)
    assert digest == GOLDEN_SHA256
    out = get_codec("pca").decode(memoryview(payload), tuple(kv.shape), kv.dtype, p)
    assert torch.equal(out[:, :, :2], kv[:, :, :2])  # positions 2 and 3: sinks
    calmod._loaded.clear()


def test_calibration_bytes_are_the_same_at_every_save(tmp_path):
    """One calibration saved twice (and in two processes) has one name: its bytes are laid out one
    fixed way (format-spec/pca.md §3), not in the metadata order safetensors happens to pick."""
    import subprocess
    import sys

    from kvtool.codecs.pca.calibration import from_bytes

    rng = np.random.default_rng(5)
    L, C, D = 2, 8, 8
    basis = np.linalg.qr(rng.standard_normal((C, C)))[0]
    cal = calmod.Calibration(
        mean=rng.standard_normal((2, L, C)).astype(np.float32),
        weight=rng.uniform(0.5, 2, (2, L, C)).astype(np.float32),
        basis=np.rint(np.broadcast_to(basis, (2, L, C, C)) * 16384).astype(np.int16),
        inv_freq=np.array([[1, 0.1, 0.01, 0.001]] * L, np.float32), head_dim=D, model="m" * 16)
    first = cal.to_bytes()
    assert all(cal.to_bytes() == first for _ in range(20))
    path = tmp_path / "cal.bin"
    path.write_bytes(first)
    again = subprocess.run([sys.executable, "-c", "import sys, pathlib\n"
                            "from kvtool.codecs.pca.calibration import from_bytes\n"
                            "sys.stdout.buffer.write(from_bytes(pathlib.Path(sys.argv[1]).read_bytes()).to_bytes())",
                            str(path)], capture_output=True, check=True).stdout
    assert again == first
    back = from_bytes(first)
    assert np.array_equal(back.basis, cal.basis) and np.array_equal(back.weight, cal.weight)
    assert cal.save(tmp_path).digest == cal.save(tmp_path / "other").digest


def test_row_gains_follow_the_square_root_of_sensitivity_within_limits():
    from kvtool.ops.calibrate import row_gains

    s = np.array([[1.0, 4.0, 16.0, 0.25], [1.0, 1.0, 1.0, 1.0]])
    g = row_gains(s)
    assert g.shape == (2, 4) and abs(np.log(g).mean()) < 1e-12  # geometric mean 1: a step keeps its rate
    assert np.allclose(g[0] / g[0, 0], [1, 2, 4, 0.5])  # the square root of the ratio
    g = row_gains(np.array([[1.0, 1.0, 1e-9, 1e9]]))
    assert np.isclose(g.max() / g.min(), 16)  # within [1/4, 4] before the rescale: a row of ~0 is not dropped
    assert np.allclose(row_gains(np.full((2, 3), 0.01)), 1)


def test_with_gains_scales_only_the_rows_weights():
    from kvtool.ops.calibrate import with_gains

    rng = np.random.default_rng(2)
    L, C = 3, 8
    cal = calmod.Calibration(mean=rng.standard_normal((2, L, C)).astype(np.float32),
                             weight=rng.uniform(0.5, 2, (2, L, C)).astype(np.float32),
                             basis=rng.integers(-16384, 16384, (2, L, C, C)).astype(np.int16),
                             inv_freq=np.ones((L, 4), np.float32), head_dim=8, model="m", digest="x" * 64)
    g = np.array([[1.0, 2.0, 0.5], [4.0, 1.0, 0.25]])
    out = with_gains(cal, g)
    assert out.digest == "" and out.basis is cal.basis and np.array_equal(out.mean, cal.mean)
    assert np.allclose(out.weight, cal.weight * g[:, :, None], rtol=1e-6)
    out.check()
