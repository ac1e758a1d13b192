"""kvtool: capture, keep, shrink, inspect, verify and replay LLM KV caches.

The Python API, loaded on first use (so `import kvtool` is cheap and imports no torch)::

    import kvtool

    model = kvtool.load_model()                       # the embedded default model, or a HF folder
    ids = model.tokenizer.encode("The KV cache is ...")
    kvtool.capture(model, ids, "notes.kvc", codec="zstd")      # -> CaptureResult
    with kvtool.open("notes.kvc") as f:                         # -> ContainerReader
        kv = f.read_chunk(0)                                     # [2, layers, tokens, kv_heads*head_dim]
    kvtool.verify("notes.kvc")                                  # -> VerifyReport; VerificationFailed if not intact
    kvtool.inspect("notes.kvc").totals                          # -> FileSummary
    kvtool.replay("notes.kvc", model, continue_tokens=8).continuation   # -> ReplayResult
    store = kvtool.open_store("kvstore")                        # a folder, or "redis://host:6379/0"
    store.for_model(model.identity).lookup(ids)                 # tokens covered by stored chunks

With Hugging Face transformers (`import kvtool.hf`, which imports transformers)::

    cache, input_ids = kvtool.hf.to_cache("notes.kvc", hf_model)   # ready for hf_model.generate
    kvtool.hf.from_cache(cache, token_ids, "out.kvc", hf_model)     # a transformers cache to a file

Every failure is a `kvtool.errors.KvtoolError` subclass.
"""

from __future__ import annotations

from .lazy import lazy_attributes
from .version import __version__

_EXPORTS = {
    # files
    "open": ("kvtool.format", "open_container"),
    "ContainerReader": ("kvtool.format", "ContainerReader"),
    "ContainerWriter": ("kvtool.format", "ContainerWriter"),
    "ModelIdentity": ("kvtool.identity", "ModelIdentity"),
    # the model
    "load_model": ("kvtool.engine", "load_model"),
    # operations
    "capture": ("kvtool.ops.capture", "capture"),
    "capture_prompt": ("kvtool.ops.capture", "capture_prompt"),
    "replay": ("kvtool.ops.replay", "replay"),
    "verify": ("kvtool.ops.verify", "verify"),
    "inspect": ("kvtool.ops.inspect", "inspect"),
    "compress": ("kvtool.ops.compress", "compress"),
    "dump": ("kvtool.ops.dump", "dump"),
    "info": ("kvtool.ops.info", "info"),
    # the chunk store (format-spec/store.md)
    "open_store": ("kvtool.store", "open_store"),
    # errors
    "KvtoolError": ("kvtool.errors", "KvtoolError"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = ["__version__", *_EXPORTS]
