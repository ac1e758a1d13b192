"""The backend's settings, read once from SGLang's `--hicache-storage-backend-extra-config`, with
the vLLM connector's keys where they mean the same: `store`, `codec`, `namespace`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import KvtoolError
from ...store.names import ExtraKeys

#: SGLang's own keys in the same JSON object (the dynamic loader's, its file backend's): not ours.
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}


@dataclass(frozen=True)
class BackendConfig:
    store_url: str  # a folder, file://, redis://, redis+cluster://... (open_store's URL)
    namespace: str  # the user's partition of a shared store ("" for none)
    model: str | None  # the model folder whose identity names the pages (None: SGLang's model path)
    memory_bytes: int  # an in-process memory tier in front of the store (0: none)


def read_config(extra: dict[str, Any] | None) -> BackendConfig:
    """The settings; a bad one is a ValueError of one line (SGLang refuses to start)."""
    extra = dict(extra or {})
    url = extra.get("store")
    if not url:
        raise ValueError("kvtool HiCache backend needs extra config 'store': a folder or redis://...")
    codec = extra.get("codec", "raw")
    if codec != "raw":  # a page is one tensor object (store.md §4.3), stored as its bytes are
        raise ValueError(f"kvtool HiCache backend: codec {codec!r}: SGLang pages are stored raw (codec 'raw')")
    namespace = extra.get("namespace") or ""
    try:  # the same checks a vLLM request's namespace gets
        ExtraKeys(namespace=namespace)
    except KvtoolError as err:
        raise ValueError(f"kvtool HiCache backend: {err}") from None
    memory = int(extra.get("memory_bytes", 0))
    if memory < 0:
        raise ValueError(f"kvtool HiCache backend: memory_bytes must be >= 0, got {memory}")
    model = extra.get("model")
    return BackendConfig(store_url=str(url), namespace=namespace, model=str(model) if model else None,
                         memory_bytes=memory)
