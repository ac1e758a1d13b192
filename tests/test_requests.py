"""The operations' requests and the CLI's typed renderers, without a model.

`ReplayRequest`, `BlendRequest`, `CaptureRequest` and `PromptCaptureRequest` check every option
once, when they are made (before anything is opened or loaded), with the one-line usage errors
the commands print; the keyword functions (`replay`, `blend_replay`, `capture_prompt`,
`capture`) build them. The human renderers take the typed result, its strings escaped: markup
in a path or a continuation prints literally.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from kvtool.cli.output import emit, escaped
from kvtool.errors import UsageError
from kvtool.format.layout import MAX_CHUNK_SIZE
from kvtool.ops.blend import BlendReplayResult, BlendRequest, SegmentReport, blend_replay
from kvtool.ops.capture import CaptureRequest, CaptureResult, PromptCaptureRequest, capture_prompt
from kvtool.ops.replay import ReplayRequest, ReplayResult, replay

# --- replay ----------------------------------------------------------------------------------------

REPLAY_ERRORS = [
    ({}, "give a KV file or --store URL"),
    ({"path": "x.kvc", "store": "s"}, "give a KV file or --store URL, not both"),
    ({"path": "x.kvc", "namespace": "a"}, "--namespace names a partition of the store: give --store URL"),
    ({"path": "x.kvc", "suffix": "a", "prompt": "b"},
     "give at most one of --suffix, --suffix-file, --prompt, --prompt-file"),
    ({"path": "x.kvc", "chat": True}, "--chat formats a new prompt: give --prompt or --prompt-file"),
    ({"path": "x.kvc", "min_top1": 2.0}, "--min-top1 2.0: expected a fraction in [0, 1]"),
    ({"path": "x.kvc", "max_kl": -1.0}, "--max-kl -1.0: expected a finite number >= 0"),
    ({"path": "x.kvc", "continue_tokens": 0}, "--continue must be at least 1"),
    ({"path": "x.kvc", "model_dtype": "int8"}, "--model-dtype 'int8': expected fp32, bf16 or fp16"),
    ({"path": "x.kvc", "device": "gpu"}, "--device 'gpu': expected auto, cpu, cuda or cuda:N"),
    ({"store": "s"}, "replay --store needs the prompt: --prompt or --prompt-file"),
    ({"path": "x.kvc", "engine": "vllm"}, "--engine must be one of kvtool, hf, got 'vllm'"),
    ({"path": "x.kvc", "prompt": "p", "generation_prompt": False}, "--no-generation-prompt applies to --chat"),
]


@pytest.mark.parametrize("options,message", REPLAY_ERRORS)
def test_a_replay_request_refuses_what_the_command_refuses(options, message):
    options = dict(options)
    with pytest.raises(UsageError) as err:
        ReplayRequest(**options)
    assert str(err.value) == message
    path = options.pop("path", None)  # the keyword function says the same, before opening anything
    with pytest.raises(UsageError) as err:
        replay(path, **options)
    assert str(err.value) == message


def test_a_replay_request_is_frozen_and_resolves_what_it_checked():
    request = ReplayRequest(path="x.kvc", device="cpu", model_dtype="bf16", max_kl=0.1)
    assert (request.torch_model_dtype, request.where, request.compares) == (torch.bfloat16, torch.device("cpu"), True)
    assert not ReplayRequest(path="x.kvc", device="cpu").compares
    assert ReplayRequest(store="s", prompt="p", namespace="team", device="cpu").extra_keys.namespace == "team"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.continue_tokens = 0
    with pytest.raises(UsageError, match="--continue must be at least 1"):  # a changed copy is checked again
        dataclasses.replace(request, continue_tokens=0)


# --- blend -----------------------------------------------------------------------------------------

BLEND_ERRORS = [
    ({"files": ("a.kvc",), "prompt": "q", "recompute_ratio": 1.5}, "--recompute-ratio 1.5: expected a fraction in [0, 1]"),
    ({"files": ("a.kvc",), "prompt": "q", "min_top1": -0.1}, "--min-top1 -0.1: expected a fraction in [0, 1]"),
    ({"files": ("a.kvc",), "prompt": "q", "max_kl": float("inf")}, "--max-kl inf: expected a finite number >= 0"),
    ({"files": ("a.kvc",), "prompt": "q", "continue_tokens": 0}, "--continue must be at least 1"),
    ({"files": ("a.kvc",)}, "--blend needs the question or the delimited prompt: --prompt or --prompt-file (one)"),
    ({"files": ("a.kvc",), "prompt": "q", "prompt_file": Path("q.txt")},
     "--blend needs the question or the delimited prompt: --prompt or --prompt-file (one)"),
    ({"prompt": "q"}, "give segment files (--blend FILE) or a delimited prompt (--blend-delimiter)"),
    ({"files": ("a.kvc",), "prompt": "q", "store": "s"},
     "--store with --blend: segments are found in the store by splitting the prompt: give --blend-delimiter"),
    ({"prompt": "a # # q", "delimiter": " # # ", "chunk_size": 8}, "--chunk-size applies to --store"),
    ({"prompt": "a # # q", "delimiter": " # # ", "namespace": "n"},
     "--namespace names a partition of the store: give --store URL"),
    ({"prompt": "a # # q", "delimiter": "\udcff"}, None),  # not UTF-8: a PromptError, not a usage error
    ({"files": ("a.kvc",), "prompt": "q", "model_dtype": "fp8"}, "--model-dtype 'fp8': expected fp32, bf16 or fp16"),
    ({"files": ("a.kvc",), "prompt": "q", "device": "tpu"}, "--device 'tpu': expected auto, cpu, cuda or cuda:N"),
]


@pytest.mark.parametrize("options,message", BLEND_ERRORS)
def test_a_blend_request_refuses_what_the_command_refuses(options, message):
    from kvtool.errors import PromptError

    options = dict(options)
    expected = UsageError if message is not None else PromptError
    with pytest.raises(expected) as err:
        BlendRequest(**options)
    assert message is None or str(err.value) == message
    if message is None:
        assert str(err.value) == "--blend-delimiter: not valid UTF-8 text"
    files = list(options.pop("files", ()))
    with pytest.raises(expected) as again:  # the keyword function: the same, before reading anything
        blend_replay(files, **options)
    assert str(again.value) == str(err.value)


def test_a_blend_request_resolves_its_defaults():
    from kvtool.engine.blend import DEFAULT_RECOMPUTE_RATIO

    request = BlendRequest(files=("a.kvc",), prompt="q", device="cpu")
    assert (request.ratio, request.recompute_ratio, request.compares) == (DEFAULT_RECOMPUTE_RATIO, None, False)
    assert BlendRequest(files=("a.kvc",), prompt="q", recompute_ratio=0.0, min_top1=0.5, device="cpu").ratio == 0.0
    assert BlendRequest(files=("a.kvc",), prompt="q", min_top1=0.5, device="cpu").compares


# --- capture ---------------------------------------------------------------------------------------

CAPTURE_ERRORS = [
    ({"output": None}, "give -o OUT, --store URL, or both"),
    ({"namespace": "a"}, "--namespace names a partition of the store: give --store URL"),
    ({"segment": True, "hidden_states": True},
     "--segment and --hidden-states: a segment's hidden states are not those of a prompt it is placed in"),
    ({"chunk_size": 0}, f"--chunk-size must be in 1..{MAX_CHUNK_SIZE}, got 0"),
    ({"block_size": 100000000000}, f"--block-size must be in 1..{MAX_CHUNK_SIZE}, got 100000000000"),
    ({"kv_dtype": "int4"}, None),  # the dtype's own message, after "--dtype: "
    ({"roi": "5:5"}, "--roi range 5:5 is empty or negative"),
    ({"codec": "raw", "level": 3}, "--level and --shuffle apply to the zstd codec only"),
    ({"prompt": "p", "prompt_file": Path("p.txt")}, "give exactly one of --prompt, --prompt-file or --tokens"),
    ({"prompt": None}, "give exactly one of --prompt, --prompt-file or --tokens"),
    ({"prompt": None, "tokens_file": Path("t.json"), "chat": True},
     "--chat formats a prompt; --tokens are token ids already"),
    ({"segment": True, "chat": True},
     "--segment is text to place inside other prompts: --chat would wrap it in a chat template"),
    ({"model_dtype": "int8"}, "--model-dtype 'int8': expected fp32, bf16 or fp16"),
    ({"device": "cuda:x"}, "--device 'cuda:x': expected auto, cpu, cuda or cuda:N"),
    ({"engine": "vllm"}, "--engine must be one of kvtool, hf, got 'vllm'"),
    ({"generation_prompt": False}, "--no-generation-prompt applies to --chat"),
    ({"engine": "hf", "block_size": 32},
     "--block-size is kvtool's paged cache; transformers' cache (--engine hf) is one block"),
]


@pytest.mark.parametrize("options,message", CAPTURE_ERRORS)
def test_capture_prompt_refuses_bad_options_before_the_model_loads(options, message, tmp_path):
    given = {"output": tmp_path / "x.kvc", "prompt": "p", "device": "cpu", **options}
    with pytest.raises(UsageError) as err:
        capture_prompt(given.pop("output"), model=tmp_path / "no model here", **given)  # never loaded
    assert message is None and str(err.value).startswith("--dtype: ") or str(err.value) == message
    assert not (tmp_path / "x.kvc").exists()


def test_capture_requests_are_frozen_and_parse_the_command_lines_spelling(tmp_path):
    request = CaptureRequest(tmp_path / "x.kvc", codec="zstd", level=5, shuffle=False, kv_dtype="fp16",
                             roi="0:4,8:9", store="s", namespace="team")
    assert (request.kv_dtype, request.roi, request.extra_keys.namespace) == ("float16", [(0, 4), (8, 9)], "team")
    assert request.torch_kv_dtype == torch.float16
    assert CaptureRequest(None, store="s", kv_dtype=torch.bfloat16).kv_dtype == "bfloat16"  # a torch dtype is named
    assert request.params["level"] == 5 and request.params["shuffle"] == "none"
    assert CaptureRequest(None, store="s").params is None  # the codec's defaults, as `capture` takes them
    given = {"version": 1, "level": 3, "shuffle": "byteplane"}
    assert CaptureRequest(None, store="s", codec="zstd", params=given).params is given  # the Python API's, as they are
    for option in ({"level": 5}, {"quality": "95", "bitstream": 2}, {"bitstream": 2}):
        with pytest.raises(UsageError, match=f"^params and {', '.join(option)}: give the codec's parameters as params "
                                             "or as options, not both"):
            CaptureRequest(None, store="s", codec="pca", params=given, **option)
    # options become params once: a copy (capture's own, adding the prompt's metadata) keeps them
    copy = dataclasses.replace(request, metadata={"a": "b"})
    assert copy.params == request.params and (copy.level, copy.shuffle) == (None, None)
    assert dataclasses.replace(request, params=None, level=7).params["level"] == 7  # new options: params=None
    pca = CaptureRequest(None, store="s", codec="pca", quality="95", bitstream=2)  # (the model's calibration: later)
    assert (pca.params, pca.quality, pca.bitstream) == (None, "95", 2)
    prompt = PromptCaptureRequest(request, prompt="p", device="cpu", model_dtype="bf16")
    assert (prompt.torch_model_dtype, prompt.where) == (torch.bfloat16, torch.device("cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.chat = True


def test_the_requests_are_checked_without_torch():
    """A usage error answers before torch loads (issue: 1.7-2.7 s for a typo): the requests'
    module, made and checked in a fresh interpreter, imports no torch (and replay's and blend's
    no numpy); resolving the device does."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from kvtool.ops.requests import BlendRequest, CaptureRequest, PromptCaptureRequest, ReplayRequest\n"
            "from kvtool.errors import UsageError\n"
            "r = ReplayRequest(path='x.kvc', device='cpu', min_top1=0.5, store=None)\n"
            "BlendRequest(files=('a.kvc',), prompt='q')\n"
            "assert 'numpy' not in sys.modules, 'numpy was imported'  # (a codec's options import it)\n"
            "p = PromptCaptureRequest(CaptureRequest('x.kvc', kv_dtype='fp16', roi='0:4'), prompt='p')\n"
            "b = BlendRequest(files=('a.kvc',), prompt='q', recompute_ratio=0.2)\n"
            "for bad in (dict(path='x.kvc', device='gpu'), dict(path='x.kvc', continue_tokens=0)):\n"
            "    try:\n"
            "        ReplayRequest(**bad)\n"
            "    except UsageError:\n"
            "        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert str(r.where) == 'cpu' and 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- rendering the typed results -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def renderers(monkeypatch):
    """Every command's renderer registered, as the CLI's app registers them, printing to a console
    wide enough that no line wraps."""
    from rich.console import Console

    importlib.import_module("kvtool.cli.app")
    monkeypatch.setattr("kvtool.cli.output.stdout_console", Console(highlight=False, width=4096))


def _replay_result(**changes) -> ReplayResult:
    fields = dict(file="[b]x.kvc", model="m", num_tokens=40, reused_tokens=32, computed_tokens=8, chunks_loaded=2,
                  codecs=["raw", "zstd"], device="cpu", model_dtype="float32", first_token_from="prefill",
                  weights="same weights", load_s=0.004, ttft_cached_s=0.02, continue_tokens=4,
                  continuation_tokens=[1, 2, 3, 4], continuation=" a [i]b[/i] c d")
    return ReplayResult(**{**fields, **changes})


def test_the_replay_renderer_reads_the_result_by_attribute(capsys):
    compared = _replay_result(ttft_recompute_s=0.1, speedup=5.0, top1_agreement=0.75, greedy_identical_tokens=2,
                              kl_mean=0.01, kl_max=0.05, delta_nll=0.002, cached_continuation=" a [i]b[/i] x y",
                              cached_continuation_tokens=[1, 2, 7, 8], agreed_continuation=" a [i]b[/i]",
                              failures=["top-1 agreement 0.750 < 0.9"])
    emit(compared, False)
    out = capsys.readouterr().out
    assert "[b]x.kvc on m (cpu): 32 of 40 tokens from the cache (2 chunks, raw, zstd), 8 computed" in out
    assert "time to first token 20ms with the cache (load 4ms) vs 100ms recomputed: 5.0x" in out
    assert "top-1 agreement 75.0%, greedy identical for 2/4 tokens, KL mean 0.01 max 0.05, ΔNLL +0.0020" in out
    assert "alike for 2 of 4 tokens: ' a [i]b[/i]'" in out
    assert "then the recompute: ' c d'" in out and "then the cache:    ' x y'" in out
    assert "FAIL top-1 agreement 0.750 < 0.9" in out
    emit(_replay_result(first_token_from="hidden_states", weights="other weights (allowed by --allow-other-weights)"),
         False)
    out = capsys.readouterr().out
    assert "the first new token from the stored hidden states" in out and "other weights (allowed" in out
    assert "continuation: ' a [i]b[/i] c d'" in out


def test_the_blend_renderer_reads_segments_by_attribute(capsys):
    result = BlendReplayResult(
        model="[m]", device="cpu", model_dtype="float32", kv_dtype="float32", num_tokens=30, question_tokens=6,
        cached_tokens=20, segments=[SegmentReport("seg[1].kvc", 12, 12, 0, True), SegmentReport("text", 4, 0),
                                    SegmentReport("store", 8, 8, 0)],
        recompute_ratio=0.15, check_layer=1, prefix_tokens=12, recomputed_cached=3, recompute_fraction=0.375,
        computed_tokens=13, load_s=0.002, ttft_blend_s=0.03, continue_tokens=3, continuation_tokens=[1, 2, 3],
        continuation=" yes", ttft_full_s=0.06, ttft_naive_s=0.02, speedup=2.0,
        blend={"top1_agreement": 1.0, "greedy_identical_tokens": 3, "kl_mean": 0.001, "kl_max": 0.002,
               "delta_nll": 0.0}, naive={"top1_agreement": 0.5, "greedy_identical_tokens": 1, "kl_mean": 0.3,
                                         "kl_max": 0.9, "delta_nll": 0.1},
        blend_continuation=" yes", blend_continuation_tokens=[1, 2, 3], agreed_continuation=" yes")
    emit(result, False)
    out = capsys.readouterr().out
    assert "blend of 3 segments and the question on [m] (cpu): 30 tokens, 20 cached (12 from seg[1].kvc, 8 from store)" \
        in out
    assert "3 cached tokens recomputed + 10 uncached computed; the first 12 tokens an exact prefix" in out
    assert "vs full prefill 60ms: 2.0x; naive reuse 20ms" in out
    assert "blend: top-1 agreement 100.0%, greedy identical for 3/3" in out
    assert "naive: top-1 agreement 50.0%, greedy identical for 1/3" in out
    assert "the blend's own:             ' yes'" in out


def test_the_capture_renderer_reads_the_result_by_attribute(capsys):
    result = CaptureResult(output=None, model="m", fingerprint="sha256:0", num_tokens=64, num_chunks=2,
                           chunk_size=32, codec="zstd", kv_dtype="bfloat16", device="cpu", model_dtype="float32",
                           block_size=16, extras=[], file_bytes=2048, decoded_bytes=4096, stored_bytes=1900,
                           seconds=0.5, prefill_tokens_per_s=128.0,
                           timings={"prefill_s": 0.5, "connector_s": 0.01, "writer_s": 0.02, "waiting_s": 0.005,
                                    "overhead_share": 0.03},
                           store={"store": "file:///s[x]", "chunks": 2, "stored": 1, "present": 1},
                           segment={"version": 1, "stored_start": 0})
    emit(result, False)
    out = capsys.readouterr().out
    assert "captured: 64 tokens of m KV (bfloat16) in 2 zstd chunks; a segment (positions from 0, placeable " \
           "anywhere), 2.0KiB" in out
    assert "waited 5ms (3.0% of prefill)" in out
    assert "file:///s[x]: 1 of 2 whole chunks stored, 1 already there" in out
    emit(dataclasses.replace(result, engine="hf", block_size=64), False)
    assert "prefill with transformers on cpu 0.50s" in capsys.readouterr().out


def test_the_renderers_say_when_transformers_ran_the_model(capsys):
    emit(_replay_result(engine="hf"), False)
    assert "[b]x.kvc on m (cpu, transformers): 32 of 40 tokens from the cache" in capsys.readouterr().out


def test_the_store_renderer_reads_nested_results_and_properties(capsys):
    from kvtool.ops.store import IngestedFile, StorePutResult

    result = StorePutResult(store="/s", files=[IngestedFile("[a].kvc", "m", 16, 3, 2, 1, 2048),
                                               IngestedFile("b.kvc", "m", 16, 1, 0, 1, 0)])
    emit(result, False)
    out = capsys.readouterr().out
    assert "[a].kvc: 3 whole chunks of m (chunk size 16): 2 stored, 1 already there" in out
    assert "/s: 2 of 4 chunks stored (2.0KiB), 2 deduplicated" in out


def test_escaped_copies_a_result_and_leaves_it_as_it_was():
    result = _replay_result(failures=["[x]"])
    literal = escaped(result)
    assert type(literal) is ReplayResult and literal is not result
    assert (literal.file, literal.failures, literal.ok) == ("\\[b]x.kvc", ["\\[x]"], False)
    assert (result.file, result.failures) == ("[b]x.kvc", ["[x]"])
    assert result.to_dict() == _replay_result(failures=["[x]"]).to_dict()  # --json sees the fields as they are
    segments = escaped(BlendReplayResult(
        model="m", device="cpu", model_dtype="float32", kv_dtype="float32", num_tokens=1, question_tokens=1,
        cached_tokens=0, segments=[SegmentReport("[s]", 1, 0)], recompute_ratio=0.0, check_layer=1, prefix_tokens=0,
        recomputed_cached=0, recompute_fraction=0.0, computed_tokens=1, load_s=0.0, ttft_blend_s=0.0,
        continue_tokens=1, continuation_tokens=[1], continuation="")).segments
    assert type(segments[0]) is SegmentReport and segments[0].source == "\\[s]"
