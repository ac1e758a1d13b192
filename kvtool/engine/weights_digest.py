"""The weights digest (format-spec/container.md §3.1): which weights a KV cache was computed with.

The fingerprint covers a model's configuration only, so a fine-tune of the same architecture
shares it; the digest tells them apart:

    weights_digest = "sha256:" + hex(SHA-256( for each weights file, in name order:
                         UTF-8 file name || 0x00 || SHA-256(file bytes) ))

over the `*.safetensors` files the model loads. Hashing reads every byte once (~0.5-2 GB/s), so
each file's SHA-256 is cached under the kvtool cache root, keyed by its path, size and mtime: the
next load of an unchanged folder costs a stat per file.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import KvtoolError
from ..fsutil import atomic_write, cache_root
from ..notices import notice

CACHE_NAME = "weights-sha256.json"
_READ = 1 << 24


def weights_digest(folder: Path, files: list[str]) -> str:
    """The digest of `files` (names inside `folder`), each file's hash cached."""
    folder = Path(folder)
    cache = _read_cache()
    keys = {name: _key(folder / name) for name in files}
    known = {name: _cached(cache, key) for name, key in keys.items()}
    missing = [name for name, digest in known.items() if digest is None]
    if missing:
        size = sum(keys[name][1] for name in missing)
        if size > 256 * 2**20:  # seconds of hashing, once per folder: say why this load is slower
            notice(f"computing the weights digest of {folder.name} once ({size / 2**30:.1f} GiB; cached after)")
        with ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1)) as pool:
            for name, digest in zip(missing, pool.map(lambda n: file_sha256(folder / n), missing)):
                path, size, mtime = keys[name]
                cache[path] = [size, mtime, digest]
                known[name] = digest
        _write_cache(cache)
    outer = hashlib.sha256()
    for name in files:
        outer.update(name.encode("utf-8") + b"\0" + bytes.fromhex(known[name]))
    return "sha256:" + outer.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            digest.update(block)  # hashlib releases the GIL: files hash in parallel
    return digest.hexdigest()


def _key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _cached(cache: dict, key: tuple[str, int, int]) -> str | None:
    """The cached hash of an unchanged file (same size and mtime), else None."""
    entry = cache.get(key[0])
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == [key[1], key[2]] and isinstance(entry[2], str):
        return entry[2]
    return None


def _cache_path() -> Path:
    return cache_root() / CACHE_NAME


def _read_cache() -> dict[str, list]:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict[str, list]) -> None:
    try:
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write(_cache_path(), lambda f: f.write(json.dumps(cache, indent=0).encode()))
    except (KvtoolError, OSError):  # a read-only cache only costs the next run the hashing again
        pass
