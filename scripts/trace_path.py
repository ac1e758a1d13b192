"""Trace a data path through kvtool, call by call, from a real run: the chain of kvtool frames on
the stack at the moment the bytes arrive (a replay: the first copy into the paged buffers; a save:
the first write of a store object), the modules it enters, and how often a call climbs back up
to a layer the path had already left (ARCHITECTURE.md's rows; a callback into a higher row).

    python scripts/trace_path.py replay FILE.kvc [--repo DIR]   # `kvtool replay FILE --continue 1`
    python scripts/trace_path.py replay-store STORE PROMPT_FILE   # `kvtool replay --store STORE --prompt-file F`
    python scripts/trace_path.py store-save [--repo DIR]        # a prefix saved to a folder store
                                                                # as the vLLM connector's worker does

`--repo` traces another checkout (e.g. a worktree of an older commit) with the same hooks, so
the two traces compare. Loads run on one thread (KVTOOL_THREADS=1) so the whole path is one stack
(`--threads N` for more: a run of raw chunks is copied from the calling thread then too).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

# ARCHITECTURE.md's rows: a smaller number is a higher layer
ROWS = [("kvtool/cli/", 1), ("kvtool/ops/", 2), ("kvtool/integrations/", 2), ("kvtool/store/", 3),
        ("kvtool/engine/", 4), ("kvtool/connectors/", 4), ("kvtool/format/", 4), ("kvtool/load/", 4),
        ("kvtool/codecs/", 5), ("kvtool/cuda_build.py", 6), ("kvtool/chunk_source.py", 6),
        ("kvtool/checksum.py", 7), ("kvtool/devices.py", 7), ("kvtool/dtypes.py", 7), ("kvtool/identity.py", 7),
        ("kvtool/fsutil.py", 8), ("kvtool/errors.py", 9), ("kvtool/notices.py", 9)]


def row(module: str) -> int:
    return next((r for prefix, r in ROWS if module.startswith(prefix)), 9)


def kvtool_frames(repo: Path) -> list[tuple[str, str]]:
    """(module path, function) of each kvtool frame on the current stack, outermost first."""
    out = []
    for frame in traceback.extract_stack()[:-2]:
        path = Path(frame.filename).resolve()
        try:
            rel = path.relative_to(repo)
        except ValueError:
            continue
        if rel.parts[0] == "kvtool":
            out.append((str(rel), frame.name))
    return out


def report(title: str, frames: list[tuple[str, str]]) -> None:
    stops = [f"{module}:{function}" for module, function in frames]
    modules, climbs = [], 0
    for i, (module, _function) in enumerate(frames):
        if not modules or modules[-1] != module:
            modules.append(module)
        if i and row(module) < row(frames[i - 1][0]):
            climbs += 1
    print(f"## {title}")
    print(f"{len(stops)} calls, {len(modules)} module stops ({len(set(modules))} modules), "
          f"{climbs} calls back up to a higher layer")
    for i, stop in enumerate(stops):
        up = "  <- back up" if i and row(frames[i][0]) < row(frames[i - 1][0]) else ""
        print(f"  {i + 1:2d}. {stop}{up}")


class Entries:
    """Every kvtool module a run enters (sys.setprofile calls), in order, until `stop()`; calls made
    inside the engine (model loading, tokenizing, compute: the same in any path) are left out.
    A call from a module into one on a higher row is a climb back up (a callback)."""

    def __init__(self, repo: Path):
        self.repo, self.modules, self.climbs, self.calls, self.on = str(repo) + "/", [], 0, 0, True
        self.climbed: list[str] = []
        sys.setprofile(self.profile)

    def module(self, frame) -> str | None:
        name = frame.f_code.co_filename
        return name[len(self.repo):] if name.startswith(self.repo + "kvtool/") else None

    def profile(self, frame, event, arg) -> None:
        if event != "call" or not self.on:
            return
        callee = self.module(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and self.module(caller_frame) is None:
            caller_frame = caller_frame.f_back
        if frame.f_code.co_name == "<module>":
            return  # a module imported: not a step of the path
        outer = caller_frame
        while outer is not None:  # inside the engine (not the data path), or inside an import
            module = self.module(outer)
            if module is not None and (module.startswith("kvtool/engine/") or outer.f_code.co_name == "<module>"):
                return
            outer = outer.f_back
        if callee.startswith("kvtool/engine/"):
            return
        caller = self.module(caller_frame) if caller_frame is not None else None
        self.calls += 1
        if caller is not None and caller != callee and row(callee) < row(caller):
            self.climbs += 1
            pair = f"{caller.removeprefix('kvtool/')} -> {callee.removeprefix('kvtool/')}:{frame.f_code.co_name}"
            if pair not in self.climbed:
                self.climbed.append(pair)
        if callee not in self.modules:
            self.modules.append(callee)

    def stop(self) -> None:
        self.on = False
        sys.setprofile(None)

    def report(self) -> None:
        print(f"modules entered before the first byte lands (imports and the engine's own calls left out): "
              f"{len(self.modules)}; kvtool calls {self.calls}; calls back up to a higher layer {self.climbs}")
        print("  " + ", ".join(m.removeprefix("kvtool/") for m in self.modules))
        if self.climbed:
            print("  back up: " + "; ".join(self.climbed))


def trace_replay(repo: Path, args: list[str], title: str) -> None:
    from kvtool.cli.app import run
    from kvtool.connectors import paged_native

    seen: list = []
    entries: list = []
    names = [n for n in ("native_scatter_sources", "native_scatter_source", "native_scatter_checked", "native_scatter")
             if hasattr(paged_native, n)]
    for name in names:
        real = getattr(paged_native, name)

        def hook(*args, _real=real, **kwargs):
            if not seen:
                entries[0].stop()
                seen.append(kvtool_frames(repo))
            return _real(*args, **kwargs)
        setattr(paged_native, name, hook)
    import contextlib
    import io

    entries.append(Entries(repo))
    with contextlib.redirect_stdout(io.StringIO()):
        code = run(["replay", *args, "--continue", "1", "--json"])
    entries[0].stop()
    assert code == 0 and seen, "the replay did not scatter through the native copy"
    report(title, seen[0])
    entries[0].report()


def trace_store_save(repo: Path) -> None:
    """The vLLM connector's worker saves completed chunks with `put_sequence` on its save thread
    (kvtool.load.SavePipeline); here the same call, on the same kind of thread, into a folder."""
    import torch

    from kvtool.load import SavePipeline
    from kvtool.store import open_store
    from kvtool.store import local

    sys.path.insert(0, str(repo / "tests"))
    from fixtures import make_identity, make_kv

    seen: list = []
    real = local.LocalBackend.put_many

    def hook(self, *args, **kwargs):
        if not seen:
            seen.append(kvtool_frames(repo))
        return real(self, *args, **kwargs)
    local.LocalBackend.put_many = hook
    identity = make_identity()
    with tempfile.TemporaryDirectory() as folder:
        cache = open_store(Path(folder) / "store").for_model(identity, 16)
        kv = make_kv(identity, 64, torch.float32)
        saving = SavePipeline(max_pending=4, name="trace-save")
        saving.submit(lambda: cache.put_sequence(list(range(64)), kv, codec="raw", start=0))
        saving.close()
    assert seen, "nothing was stored"
    report("a vLLM worker's save: put_sequence on the save thread to the stored object", seen[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["replay", "replay-store", "store-save"])
    parser.add_argument("file", nargs="?")
    parser.add_argument("prompt_file", nargs="?")
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--threads", default="1", help="KVTOOL_THREADS for the run (default 1: the whole load on "
                        "one stack; a run of raw chunks is copied from the calling thread with more too)")
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    os.environ["KVTOOL_THREADS"] = args.threads
    import kvtool

    assert Path(kvtool.__file__).resolve().is_relative_to(repo), kvtool.__file__
    if args.what == "replay":
        trace_replay(repo, [args.file], f"replay {Path(args.file).name}: the CLI to the bytes in the paged buffers")
    elif args.what == "replay-store":
        trace_replay(repo, ["--store", args.file, "--prompt-file", args.prompt_file],
                     "replay --store: the CLI to the bytes in the paged buffers")
    else:
        trace_store_save(repo)


if __name__ == "__main__":
    main()
