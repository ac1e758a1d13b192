"""The one load path: chunks of KV from a file or the chunk store into an engine's paged buffers.

`load_chunks` runs a list of `ChunkTask`s (read, check and decode one chunk: each source says how)
on a few worker threads and scatters each decoded chunk into the paged buffers from the thread
that decoded it, so reading, CRC-32C, decoding and scattering of different chunks overlap. The
steps that cost release the GIL (pread, crc32c, zstd, the CacheGen coder, the native paged copy).
A raw chunk's stored bytes go to a scatter that can check them (`check=`) unchecked, and are
CRC-checked as they are copied into the paged buffers: one pass over the bytes instead of three.

On a GPU, `load_chunks_staged`: chunks read and checked into pinned buffers on worker threads,
copied to the device and scattered there on a side stream, in order, overlapping the reads.

The save side's mirror, `SavePipeline`: the caller gathers a chunk, a background thread encodes,
checksums and writes it while the caller goes on (capture's next prefill step, vLLM's next step).
Callers: `ops.replay` (a file), `store.ModelCache.get_prefix` (store objects), and through it the
vLLM connector.
"""

from .saving import SavePipeline
from .staged import load_chunks_staged
from .pipeline import ChunkTask, LoadOutcome, file_tasks, load_chunks, load_threads, takes_check

__all__ = ["SavePipeline", "load_chunks_staged", "ChunkTask", "LoadOutcome", "file_tasks", "load_chunks", "load_threads", "takes_check"]
