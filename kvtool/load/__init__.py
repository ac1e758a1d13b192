"""The one load path: stored chunks (`ChunkSource`s) into a destination's buffers.

`load(tasks, destination)` is the entry (`path.py`): each `ChunkTask` opens one chunk's source (a
container file's chunk, a store object), and the destination (a `Destination`, declared in
`kvtool.destination`: an engine's paged buffers, or tensors) takes decoded KV, or, when it says it
`takes_sources()`, a raw chunk straight from its stored bytes, CRC-checked as it is copied: one
pass over the bytes instead of three. On the CPU worker threads overlap reading,
checking, decoding and scattering (`pipeline.py`); on a GPU, pinned buffers and a side stream
(`staged.py`), and CacheGen chunks decode on the device in batches.

The save side's mirror, `SavePipeline`: the caller gathers a chunk, a background thread encodes,
checksums and writes it while the caller goes on (capture's next prefill step, vLLM's next step).
`load_blob` (`tensors.py`) loads chunks into one KV_BLOB tensor through `load`: a blended
replay's segment file.

Callers: `ops.replay` (a file), `ops.blend` (a segment file, `load_blob`), `kvtool.hf.to_cache`
(a file), `store.ModelCache.load_prefix` (store objects, and through it `replay --store`, the
store's segments of `--blend`, `kvtool.hf.to_cache` of a store and the vLLM connector).
"""

from .path import GPU_DECODE_BATCH, load
from .pipeline import ChunkTask, Destination, LoadOutcome, file_tasks, load_chunks, load_threads  # Destination: kvtool.destination
from .saving import SavePipeline
from .staged import load_chunks_staged
from .tensors import BlobTarget, load_blob

__all__ = ["BlobTarget", "ChunkTask", "Destination", "GPU_DECODE_BATCH", "LoadOutcome", "SavePipeline", "file_tasks",
           "load", "load_blob", "load_chunks", "load_chunks_staged", "load_threads"]
