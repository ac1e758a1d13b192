"""Damage one object of a store the way the world does, for tests that meet it from inside an engine
(`scripts/vllm_serve.py`'s "before" commands):

    python tests/store_damage.py STORE NAME flip|truncate

flip: one byte of the payload changed, in place (a folder's file keeps its inode and size);
truncate: the object cut to half its length. (Removal is `kvtool store rm NAME --store STORE`.)"""

from __future__ import annotations

import os
import sys


def main() -> None:
    url, name, how = sys.argv[1:4]
    from kvtool.store import open_store

    with open_store(url, create=False) as store:
        data = store.backend.get(name)
        if data is None:
            raise SystemExit(f"store_damage: {name} is not stored")
        data = bytearray(data)
        if how == "truncate":
            store.backend.put(name, bytes(data[:len(data) // 2]), replace=True)
            return
        if how != "flip":
            raise SystemExit(f"store_damage: flip or truncate, not {how!r}")
        at = len(data) * 2 // 3  # in the payload, past the header and manifest
        if os.path.isdir(url):  # in place: the same file, as a disk error or a stray write leaves it
            with open(os.path.join(url, name), "r+b") as f:
                f.seek(at)
                f.write(bytes([data[at] ^ 0x10]))
        else:
            data[at] ^= 0x10
            store.backend.put(name, bytes(data), replace=True)


if __name__ == "__main__":
    main()
