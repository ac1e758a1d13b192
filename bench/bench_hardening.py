"""What hardening costs and saves: a hostile manifest's refusal, and the weights digest.

    python bench/bench_hardening.py [--digest-gib 8] [--repeat 3]

1. A file whose 64 MiB manifest is 22 million empty JSON objects (valid CRC), made from
   format-spec/vectors/raw_bf16.kvc: `kvtool verify` on it (refused by the format's container
   bound) next to the peer, Python's json.loads of the same manifest bytes (what an unbounded
   parser pays), and `kvtool verify` of the valid vector. Each in its own process: wall time and
   peak RSS (wait4).
2. The weights digest of the default model with an empty digest cache, then cached, next to
   safetensors' load_file of the same file (what every model load pays anyway); with
   --digest-gib, also a sparse folder of that many GiB in two shards (hashing speed, not disk).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtool.format import layout  # noqa: E402
from kvtool.format.hashing import crc32  # noqa: E402

KVTOOL = [sys.executable, "-m", "kvtool"]


# Peak RSS comes from a small launcher process: a child's peak RSS starts at its parent's (Linux
# keeps the pre-exec high-water mark), and this process holds the 64 MiB manifest.
LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit code) of one process."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    return time.perf_counter() - t0, int(out[0]) / 1024, int(out[1])


def best(cmd: list[str], repeat: int, env: dict | None = None) -> tuple[float, float, int]:
    runs = [run(cmd, env) for _ in range(repeat)]
    return min(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def hostile_file(folder: Path) -> tuple[Path, int, int]:
    src = (REPO / "format-spec" / "vectors" / "raw_bf16.kvc").read_bytes()
    trailer = layout.Trailer.unpack(src[-layout.TRAILER_SIZE:], len(src))
    manifest = b"[" + b"{}," * (64 * 2**20 // 3 - 2) + b"{}]"
    path = folder / "hostile.kvc"
    path.write_bytes(src[:trailer.manifest_offset] + manifest
                     + layout.Trailer(trailer.manifest_offset, len(manifest), crc32(manifest)).pack())
    return path, trailer.manifest_offset, len(manifest)


def bench_manifest(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, offset, length = hostile_file(Path(tmp))
        peer = f"import json; json.loads(open({str(path)!r}, 'rb').read()[{offset}:{offset + length}])"
        rows = [("`kvtool verify` of the hostile file (refused)", KVTOOL + ["verify", str(path)]),
                ("peer: Python `json.loads` of the same 64 MiB manifest", [sys.executable, "-c", peer]),
                ("`kvtool verify` of the valid 2.3 KB vector", KVTOOL + ["verify", str(REPO / "format-spec/vectors/raw_bf16.kvc")])]
        print(f"## A manifest of {length / 2**20:.0f} MiB: 22 million empty objects\n")
        print("| command | best wall s | peak RSS MiB | exit |\n|---|---:|---:|---:|")
        for label, cmd in rows:
            wall, rss, code = best(cmd, repeat)
            print(f"| {label} | {wall:.2f} | {rss:.0f} | {code} |", flush=True)


def bench_digest(repeat: int, sparse_gib: float) -> None:
    from kvtool.engine.default_model import default_model_path

    folder = default_model_path()
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    size = sum((folder / f).stat().st_size for f in files) / 2**30
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KVTOOL_CACHE": cache, "PYTHONPATH": str(REPO)}
        digest = (f"from pathlib import Path; from kvtool.engine.weights_digest import weights_digest; "
                  f"weights_digest(Path({str(folder)!r}), {files!r})")
        rows.append((f"digest, empty cache ({size:.2f} GiB)", *run([sys.executable, "-c", digest], env)))
        rows.append(("digest, cached", *best([sys.executable, "-c", digest], repeat, env)))
        load = (f"from safetensors.torch import load_file; "
                f"[load_file({str(folder)!r} + '/' + name) for name in {files!r}]")
        rows.append(("peer: safetensors load_file of the same weights", *best([sys.executable, "-c", load], repeat, env)))
        bare = [sys.executable, "-c", "import kvtool.engine.weights_digest"]
        rows.append(("(the interpreter and the import alone)", *best(bare, repeat, env)))
        if sparse_gib:
            shards = Path(cache) / "sparse"
            shards.mkdir()
            names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
            for name in names:
                os.truncate(os.open(shards / name, os.O_CREAT | os.O_WRONLY), int(sparse_gib * 2**30 / 2))
            digest = (f"from pathlib import Path; from kvtool.engine.weights_digest import weights_digest; "
                      f"weights_digest(Path({str(shards)!r}), {names!r})")
            rows.append((f"digest, empty cache, sparse {sparse_gib:g} GiB in 2 shards", *run([sys.executable, "-c", digest], env)))
            rows.append(("digest, cached", *best([sys.executable, "-c", digest], repeat, env)))
    print("\n## The weights digest\n")
    print("| what | wall s | peak RSS MiB | exit |\n|---|---:|---:|---:|")
    for label, wall, rss, code in rows:
        print(f"| {label} | {wall:.2f} | {rss:.0f} | {code} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--digest-gib", type=float, default=0.0, help="also a sparse folder of this size")
    args = ap.parse_args()
    print(f"# kvtool bench_hardening: best of {args.repeat}; {os.cpu_count()} cores, "
          f"1-min load {os.getloadavg()[0]:.2f} at start\n")
    bench_manifest(args.repeat)
    bench_digest(args.repeat, args.digest_gib)


if __name__ == "__main__":
    main()
