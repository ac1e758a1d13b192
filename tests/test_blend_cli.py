"""`kvtool capture --segment` and `kvtool replay --blend` / `--blend-delimiter` on the default model.

Human and `--json` output; errors are one line on stderr starting `kvtool: error:` with a non-zero
exit code (and, with --json, `{"ok": false, "error": {...}}`), never a traceback.
"""

from __future__ import annotations


import pytest

from fixtures import cli

from kvtool.cli.app import run
from kvtool.format import ContainerReader, ContainerWriter
from kvtool.format.segment import segment_extension
from kvtool.identity import ModelIdentity

pytestmark = pytest.mark.model

DOCS = ["Alice lives in Paris. She works as a baker and her favourite colour is green.\n",
        "Bob lives in Tokyo. He writes compilers in Rust and his favourite colour is orange.\n"]
QUESTION = "\nQuestion: What is Bob's favourite colour?\nAnswer:"




def assert_one_line_error(code: int, out, err: str, want_code: int, error_type: str | None = None) -> str:
    assert code == want_code, (code, out, err)
    assert err.startswith("kvtool: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    if isinstance(out, dict):
        assert out["ok"] is False and out["error"]["exit_code"] == want_code
        if error_type is not None:
            assert out["error"]["type"] == error_type
    return err


@pytest.fixture(scope="module")
def segments(tmp_path_factory, default_model):
    """Two segment files, the question file, and a chunk store holding both segments (8-token chunks)."""
    folder = tmp_path_factory.mktemp("blend")
    paths = []
    for i, text in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_text(text)
        path = folder / f"doc{i}.kvc"
        assert run(["capture", "--segment", "--prompt-file", str(folder / f"doc{i}.txt"), "-o", str(path),
                    "--store", str(folder / "store"), "--chunk-size", "8", "--device", "cpu", "--json"]) == 0
        paths.append(path)
    (folder / "q.txt").write_text(QUESTION)
    (folder / "prompt.txt").write_text(" # # ".join(DOCS) + " # # " + QUESTION)
    return folder, paths


def test_capture_segment_marks_the_file(segments, tmp_path, capsys):
    folder, paths = segments
    with ContainerReader(paths[0]) as r:
        assert r.segment is not None and r.segment.stored_start == 0
    code, r, _ = cli(capsys, "capture", "--segment", "--prompt", DOCS[0], "-o", tmp_path / "s.kvc", "--device",
                     "cpu", "--json")
    assert code == 0 and r["segment"] == {"version": 1, "stored_start": 0}
    code, out, _ = cli(capsys, "capture", "--segment", "--prompt", DOCS[0], "-o", tmp_path / "s.kvc", "--device",
                       "cpu")
    assert code == 0 and "a segment (positions from 0" in " ".join(out.split())  # rich wraps at 80 columns
    for extra in (["--chat"], ["--hidden-states"]):
        code, out, err = cli(capsys, "capture", "--segment", *extra, "--prompt", "hi", "-o", tmp_path / "x.kvc")
        assert "--segment" in assert_one_line_error(code, out, err, 2)


def test_replay_blend_of_files_with_compare(segments, capsys):
    folder, paths = segments
    code, r, _ = cli(capsys, "replay", "--blend", paths[0], "--blend", paths[1], "--prompt-file", folder / "q.txt",
                     "--continue", "4", "--compare", "--recompute-ratio", "1.0", "--device", "cpu", "--json")
    assert code == 0 and r["ok"]
    assert [s["source"] for s in r["segments"]] == [str(p) for p in paths]
    assert r["recompute_ratio"] == 1.0 and r["check_layer"] == 1 and r["recompute_fraction"] == 1.0
    assert r["blend"]["top1_agreement"] == 1.0 and r["blend"]["kl_mean"] < 1e-3  # bf16 files captured in 8-token chunks
    assert r["naive"]["kl_mean"] > r["blend"]["kl_mean"]
    for key in ("ttft_blend_s", "ttft_full_s", "ttft_naive_s", "speedup", "load_s"):
        assert r[key] > 0
    code, out, _ = cli(capsys, "replay", "--blend", paths[0], "--blend", paths[1], "--prompt-file", folder / "q.txt",
                       "--continue", "4", "--compare", "--device", "cpu")
    assert code == 0
    out = " ".join(out.split())
    assert "blend of 2 segments and the question" in out and "recompute ratio 0.15 at check layer 1" in out
    assert "naive: top-1 agreement" in out and "vs full prefill" in out and "full prefill's continuation" in out


def test_replay_store_with_a_delimited_prompt(segments, capsys):
    folder, paths = segments
    code, r, _ = cli(capsys, "replay", "--store", folder / "store", "--prompt-file", folder / "prompt.txt",
                     "--blend-delimiter", " # # ", "--continue", "3", "--check-layer", "2", "--device", "cpu",
                     "--json")
    tokens = r["continuation_tokens"]  # 3, or fewer ending at the model's end of sequence
    assert code == 0 and r["ok"] and r["check_layer"] == 2 and 1 <= len(tokens) <= 3
    assert len(tokens) == 3 or tokens[-1] == 2  # SmolLM2's <|im_end|>
    with ContainerReader(paths[0]) as a, ContainerReader(paths[1]) as b:
        n0, n1 = a.num_tokens, b.num_tokens
    assert [(s["tokens"], s["cached_tokens"]) for s in r["segments"]] == [(n, n // 8 * 8) for n in (n0, n1)]
    assert len({s["source"] for s in r["segments"]}) == 1  # the store, both (their tails computed)
    assert r["cached_tokens"] == (n0 // 8 + n1 // 8) * 8
    # the same prompt from the files: every segment token cached
    code, r, _ = cli(capsys, "replay", "--blend", paths[1], "--blend", paths[0], "--prompt-file",
                     folder / "prompt.txt", "--blend-delimiter", " # # ", "--continue", "3", "--device", "cpu", "--json")
    assert code == 0 and r["cached_tokens"] == n0 + n1
    assert [s["source"] for s in r["segments"]] == [str(paths[0]), str(paths[1])]  # the prompt's order


def test_blend_errors_are_one_line(segments, tmp_path, capsys, default_model):
    folder, paths = segments
    q = folder / "q.txt"
    # a segment of another RoPE: refused by name before anything runs
    with ContainerReader(paths[0]) as r:
        kv, tokens = r.read_range(0, r.num_tokens), r.token_ids().tolist()
    other = {**default_model.identity.to_dict(), "rope": {"rope_theta": 10000.0, "rope_scaling": None}}
    rope = tmp_path / "rope.kvc"
    with ContainerWriter(rope, ModelIdentity.from_dict(other), tokens, kv_dtype=kv.dtype,
                         extensions=segment_extension(0)) as w:
        w.write_chunk(kv)
    code, out, err = cli(capsys, "replay", "--blend", rope, "--prompt-file", q, "--device", "cpu", "--json")
    assert "RoPE" in assert_one_line_error(code, out, err, 2, "RopeMismatch")
    other = {**default_model.identity.to_dict(), "num_layers": 12}
    layers = tmp_path / "layers.kvc"
    with ContainerWriter(layers, ModelIdentity.from_dict(other), tokens, kv_dtype=kv.dtype) as w:
        w.write_chunk(kv[:, :12])
    code, out, err = cli(capsys, "replay", "--blend", layers, "--prompt-file", q, "--device", "cpu")
    assert "not by the loaded model" in assert_one_line_error(code, out, err, 2)

    cases = [
        (["--blend", paths[0], "--prompt-file", q, "--recompute-ratio", "1.5"], "--recompute-ratio"),
        (["--blend", paths[0], "--prompt-file", q, "--check-layer", "99"], "--check-layer"),
        (["--blend", paths[0]], "--prompt"),
        ([paths[0], "--blend", paths[1], "--prompt-file", q], "FILE does not apply"),
        (["--blend", paths[0], "--prompt-file", q, "--suffix", "x"], "--suffix does not apply"),
        ([paths[0], "--recompute-ratio", "0.3"], "apply to --blend"),
        (["--blend", paths[0], "--prompt-file", q, "--blend-delimiter", " # # "], "no delimiter"),
        (["--blend", paths[0], "--prompt-file", folder / "prompt.txt", "--blend-delimiter", "@@"], "no delimiter"),
        (["--blend", paths[0], "--prompt", DOCS[1] + " # # Q", "--blend-delimiter", " # # "], "not those of any"),
        (["--store", folder / "store", "--blend", paths[0], "--prompt-file", q], "give --blend-delimiter"),
        (["--store", tmp_path / "nothing", "--prompt-file", folder / "prompt.txt", "--blend-delimiter", " # # "],
         None),
    ]
    for args, words in cases:
        code, out, err = cli(capsys, "replay", *args, "--device", "cpu", "--json")
        message = assert_one_line_error(code, out, err, 2)
        assert words is None or words in message, (args, message)
