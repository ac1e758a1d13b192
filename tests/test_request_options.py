"""Each operation's options live once, on its request (issue 47): the command is built from the
request's fields, the Python API takes the request or its fields, one name per concept, and the
names that changed still answer with a one-line deprecation. No model: real files, the real CLI."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from fixtures import cli, write_kv_file
from kvtool.cli.app import app
from kvtool.errors import UsageError
from kvtool.ops.fields import options_of
from kvtool.ops.file_requests import (CompressRequest, DumpRequest, InspectRequest, StoreFsckRequest, StoreGcRequest,
                                      StoreGetRequest, StoreListRequest, StorePutRequest, StoreRmRequest,
                                      StoreStatsRequest, VerifyRequest)
from kvtool.ops.requests import (CALIBRATION_BASES, BlendRequest, CalibrateRequest, PromptCaptureRequest,
                                 ReplayRequest)

KVTOOL = Path(__file__).resolve().parent.parent / "kvtool"

COMMANDS = {("capture",): (PromptCaptureRequest,), ("replay",): (ReplayRequest, BlendRequest),
            ("compress",): (CompressRequest,), ("dump",): (DumpRequest,), ("inspect",): (InspectRequest,),
            ("verify",): (VerifyRequest,), ("calibrate",): (CalibrateRequest,),
            ("store", "put"): (StorePutRequest,), ("store", "get"): (StoreGetRequest,),
            ("store", "ls"): (StoreListRequest,), ("store", "stats"): (StoreStatsRequest,),
            ("store", "gc"): (StoreGcRequest,), ("store", "fsck"): (StoreFsckRequest,),
            ("store", "rm"): (StoreRmRequest,)}


def click_command(path: tuple[str, ...]):
    import typer.main

    group = typer.main.get_command(app)
    for name in path:
        group = group.commands[name]
    return group


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_a_commands_options_are_its_requests_fields(path):
    """Every option and argument of the command is one field of its request, spelled as the field
    declares it (plus --json; a tri-state's hidden --no-... switch), and nothing else."""
    declared = {}
    for request_class in COMMANDS[path]:
        for field, flag in options_of(request_class):
            declared.setdefault(field.name, flag)
    params = {p.name: p for p in click_command(path).params if p.name != "json"}
    offs = {f"no_{name}" for name, flag in declared.items() if flag.off}
    assert set(params) == set(declared) | offs
    for name, flag in declared.items():
        if not flag.argument:
            spelled = {spelling for declared_flag in flag.flags for spelling in declared_flag.split("/")}
            assert set(params[name].opts) | set(params[name].secondary_opts) == spelled, name


def flag_declarations(flag: str) -> int:
    """How many calls in kvtool/ declare `flag` (an `option(...)` or a typer.Option): its name, type,
    default and help written there."""
    found = 0
    for path in KVTOOL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                    "option", "Option", "Flag"):
                if any(isinstance(a, ast.Constant) and a.value == flag for a in node.args):
                    found += 1
    return found


# (--model and --namespace also name other things: a model key in `store ls|rm`, the namespace whose
# objects `store rm` removes)
@pytest.mark.parametrize("flag", ["--model-dtype", "--codec", "--device", "--engine", "--store", "--level", "--shuffle", "--bins", "--quality", "--calibration",
                                  "--bitstream",
                                  "--min-top1", "--max-kl", "--continue", "--compare", "--prompt", "--prompt-file",
                                  "--tokens", "--allow-other-weights", "--no-generation-prompt"])
def test_a_shared_option_is_declared_once(flag):
    assert flag_declarations(flag) == 1


def test_model_dtype_has_one_name():
    """The flag --model-dtype, the field model_dtype, the torch dtype torch_model_dtype: no other
    spelling (weights_dtype, a request's .weights) is left in the code."""
    for path in (KVTOOL / "cli").glob("*.py"):
        assert "weights_dtype" not in path.read_text(encoding="utf-8"), path
    for request_class in (PromptCaptureRequest, ReplayRequest, BlendRequest, VerifyRequest):
        assert "model_dtype" in {f.name for f in dataclasses.fields(request_class)}
    assert ReplayRequest(path="x.kvc", model_dtype="bf16").torch_model_dtype.is_floating_point


def test_the_old_names_still_answer_with_a_deprecation(tmp_path):
    request = ReplayRequest(path="x.kvc", device="cpu", model_dtype="fp16")
    with pytest.warns(DeprecationWarning, match="use .torch_model_dtype"):
        assert request.weights == request.torch_model_dtype
    from kvtool.ops.capture import CaptureRequest

    with pytest.warns(DeprecationWarning, match=r"use CaptureRequest\(output, ...\)"):
        old = CaptureRequest.from_options(tmp_path / "x.kvc", codec="zstd", level=5)
    assert old == CaptureRequest(tmp_path / "x.kvc", codec="zstd", level=5)
    from kvtool.ops.calibrate import calibrate_model

    with pytest.warns(DeprecationWarning, match="use model="), pytest.raises(UsageError, match="--basis"):
        calibrate_model(model_path=tmp_path, basis="row")  # (refused before any model loads)


def test_the_calibration_bases_are_the_fits():
    from kvtool.codecs.pca.fit import BASES

    assert set(CALIBRATION_BASES) == set(BASES)


def test_the_python_api_takes_the_request_or_its_fields(tmp_path):
    from kvtool.ops.compress import compress
    from kvtool.ops.dump import dump
    from kvtool.ops.inspect import inspect
    from kvtool.ops.verify import verify

    f = write_kv_file(tmp_path / "a.kvc", num_tokens=12, chunk_size=4)
    by_fields = compress(f.path, tmp_path / "b.kvc", "zstd", level=3)
    by_request = compress(CompressRequest(f.path, tmp_path / "c.kvc", "zstd", level=3))
    assert (by_fields.codec_params, by_fields.output_bytes) == (by_request.codec_params, by_request.output_bytes)
    assert inspect(InspectRequest(f.path, all_chunks=True)).to_dict() == inspect(f.path, all_chunks=True).to_dict()
    assert verify(VerifyRequest(tmp_path / "b.kvc", against=f.path)).ok
    a = dump(DumpRequest(f.path, tmp_path / "a.npy", chunks="1"))
    b = dump(f.path, tmp_path / "b.npy", chunks="1")
    assert (a.chunks, a.num_tokens, a.bytes) == (b.chunks, b.num_tokens, b.bytes) == ([1], 4, b.bytes)
    with pytest.raises(TypeError, match="weights_dtype"):  # one name: the old one is no field
        ReplayRequest(path="x.kvc", weights_dtype="fp16")


@pytest.mark.parametrize("argv,message", [
    (["compress", "{f}", "-o", "{f}"], "the output is the input"),
    (["compress", "{f}", "-o", "{o}", "--shuffle", "--no-shuffle"], "--shuffle and --no-shuffle: give one"),
    (["compress", "{f}", "-o", "{o}", "--codec", "raw", "--level", "3"], "--level and --shuffle apply to the zstd"),
    (["dump", "{f}", "-o", "{o}"], "output must end in .safetensors or .npy"),
    (["verify", "{f}", "--model-dtype", "int8"], "--model-dtype 'int8': expected fp32, bf16 or fp16"),
    (["verify", "{f}", "--atol", "-1"], "--atol -1.0: expected a finite number >= 0"),
    (["calibrate", "--basis", "row"], "--basis must be one of head, layer, got 'row'"),
    (["store", "gc", "--store", "{s}", "--max-bytes", "lots"], "--max-bytes: 'lots' is not a size"),
    (["store", "ls", "--store", "{s}", "--kind", "blob"], "--kind: 'blob' is not one of"),
    (["store", "rm", "--store", "{s}", "--all", "--model", "ab"], "give object names, or --model KEY"),
    (["replay", "{f}", "--blend", "{f}", "--prompt", "q"], "FILE does not apply to --blend / --blend-delimiter"),
    (["replay", "--blend", "{f}", "--prompt", "q", "--engine", "hf"], "--engine hf does not apply to --blend"),
    (["replay", "--blend", "{f}", "--prompt", "q", "--no-hidden-states"], "--no-hidden-states does not apply"),
    (["replay", "{f}", "--check-layer", "2"], "--recompute-ratio and --check-layer apply to --blend"),
    (["replay", "{f}", "--model-dtype", "fp8"], "--model-dtype 'fp8': expected fp32, bf16 or fp16"),
])
def test_a_requests_refusal_is_the_commands_usage_error(tmp_path, capsys, argv, message):
    f = write_kv_file(tmp_path / "a.kvc")
    argv = [a.format(f=f.path, o=tmp_path / "out.kvc", s=tmp_path / "store") for a in argv]
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 2 and message in out["error"]["message"], (out, err)
    assert len(err.strip().splitlines()) == 1
