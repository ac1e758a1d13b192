"""`dump`: export decoded KV to safetensors or .npy.

safetensors output holds, for the selected tokens T and each selected layer i:
  layers.{i}.key    [T, num_kv_heads, head_dim]   (KV dtype)
  layers.{i}.value  [T, num_kv_heads, head_dim]
  token_ids         [T] int64
  positions         [T] int64   (position of each exported token in the sequence)
  hidden_states     [T, hidden]  (when the file has them; their dtype)
  roi_mask          [T] bool     (when the file has one)
and in the metadata the model's name, fingerprint and weights digest, the source path, and the
file's own metadata (how its KV was computed, how its prompt became tokens: the prompt format,
the chat template's digest, add_generation_prompt), which a reader needs to rebuild the input.
.npy output holds one KV_BLOB array [2, layers, T, kv_heads * head_dim]; bf16 is
widened to float32 (numpy has no bfloat16; the widening is exact). What it holds is
said beside it, in OUT.npy.json: the source, model, fingerprint, weights digest, KV dtype, the
file's metadata, the layers and chunks selected (axis 1 and 2 of the array), each token's position and id;
the file's extras at the same tokens go to OUT.hidden_states.npy and OUT.roi_mask.npy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..devices import host_memory_bytes
from ..dtypes import bfloat16_to_float32
from ..errors import OutputError, UsageError
from ..format import ContainerReader
from ..fsutil import atomic_write
from .inputs import parse_index_set
from .result import Result

# dump holds the decoded selection about three times (chunks, their concatenation, the serialised
# output); a small file may declare up to 1024x its size in KV (format-spec limits)
DUMP_MEMORY_FACTOR = 3


@dataclass
class DumpResult(Result):
    output: str
    format: str
    chunks: list[int]
    layers: list[int]
    num_tokens: int
    bytes: int
    sidecar: str | None = field(default=None)  # .npy: what the array holds, as JSON


def dump(path: str | Path, output: str | Path, *, chunks: str | None = None, layers: str | None = None,
         on_chunk: Callable[[int, int], None] | None = None) -> DumpResult:
    """Export the selected chunks and layers ('0-3,7' forms; default all) of a file, with the
    file's extras (hidden states, region-of-interest mask) at the selected tokens;
    `on_chunk(done, total)` reports progress."""
    output = Path(output)
    suffix = output.suffix.lower()
    if suffix not in (".safetensors", ".npy"):
        raise UsageError(f"output must end in .safetensors or .npy, got {output.name!r}")
    with ContainerReader(path) as reader:
        m = reader.manifest
        chunk_ids = parse_index_set(chunks, len(m.chunks), "chunks")
        layer_ids = parse_index_set(layers, m.num_layers, "layers")
        _check_memory(sum(m.chunks[i].decoded_bytes for i in chunk_ids) * len(layer_ids) // m.num_layers)
        parts = []
        for done, i in enumerate(chunk_ids, 1):
            parts.append(reader.read_chunk_array(i)[:, layer_ids])  # [2, L', T_i, C]
            if on_chunk is not None:
                on_chunk(done, len(chunk_ids))
        kv = np.concatenate(parts, axis=2)  # [2, L', T, C]
        positions = np.concatenate([np.arange(m.chunks[i].start, m.chunks[i].end) for i in chunk_ids])
        token_ids = reader.token_ids()[positions]
        extras = {name: reader.read_extra_array(name)[positions] for name in m.extras}  # at the selected tokens
    if suffix == ".safetensors":
        _write_safetensors(output, kv, token_ids, positions, extras, layer_ids, m, str(path))
        return DumpResult(output=str(output), format="safetensors", chunks=chunk_ids, layers=layer_ids,
                          num_tokens=int(kv.shape[2]), bytes=output.stat().st_size)
    sidecar = _write_npy(output, kv, token_ids, positions, extras, layer_ids, chunk_ids, m, str(path))
    return DumpResult(output=str(output), format="npy", chunks=chunk_ids, layers=layer_ids,
                      num_tokens=int(kv.shape[2]), bytes=output.stat().st_size, sidecar=str(sidecar))


def _write_npy(output: Path, kv: np.ndarray, token_ids: np.ndarray, positions: np.ndarray,
               extras: dict[str, np.ndarray], layer_ids: list[int], chunk_ids: list[int], m, source: str) -> Path:
    """OUT.npy, each extra as OUT.NAME.npy, and OUT.npy.json saying what they hold."""
    def numpy_values(array: np.ndarray, dtype: str) -> np.ndarray:  # numpy has no bfloat16: widen, bit for bit
        return bfloat16_to_float32(array) if dtype == "bfloat16" else array

    written = {}
    for name, values in extras.items():
        extra_path = output.with_name(f"{output.stem}.{name}.npy")
        array = values if values.dtype == np.bool_ else numpy_values(values, m.extras[name].dtype)
        atomic_write(extra_path, lambda f, a=array: np.save(f, a))
        written[name] = {"file": extra_path.name, "dtype": m.extras[name].dtype, "array_dtype": str(array.dtype)}
    array = numpy_values(kv, m.kv_dtype)
    atomic_write(output, lambda f: np.save(f, array))
    about = {"source": source, "model": m.model["name"], "fingerprint": m.model["fingerprint"],
             "weights_digest": m.model.get("weights_digest"), "metadata": m.metadata, "kv_dtype": m.kv_dtype, "array_dtype": str(array.dtype),
             "shape": "[2 (K, V), layers, tokens, kv_heads * head_dim]", "layers": layer_ids, "chunks": chunk_ids,
             "positions": positions.tolist(), "token_ids": token_ids.tolist(), "extras": written}
    sidecar = Path(f"{output}.json")
    atomic_write(sidecar, lambda f: f.write(json.dumps(about, indent=1).encode()))
    return sidecar


def _write_safetensors(output: Path, kv: np.ndarray, token_ids: np.ndarray, positions: np.ndarray,
                       extras: dict[str, np.ndarray], layer_ids: list[int], m, source: str) -> None:
    import torch
    from safetensors.torch import save as safetensors_save

    from ..dtypes import dtype_from_name

    per_token = torch.from_numpy(kv).view(dtype_from_name(m.kv_dtype)).view(
        2, len(layer_ids), kv.shape[2], m.num_kv_heads, m.head_dim)  # [2, L', T, H, D]
    tensors = {"token_ids": torch.from_numpy(token_ids), "positions": torch.from_numpy(positions.astype(np.int64))}
    for j, layer in enumerate(layer_ids):
        tensors[f"layers.{layer}.key"] = per_token[0, j].contiguous()
        tensors[f"layers.{layer}.value"] = per_token[1, j].contiguous()
    for name, values in extras.items():  # hidden_states [T, E] in its dtype, roi_mask [T] bool
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        tensors[name] = tensor if values.dtype == np.bool_ else tensor.view(dtype_from_name(m.extras[name].dtype))
    meta = {**m.metadata, "model": m.model["name"], "fingerprint": m.model["fingerprint"], "kv_dtype": m.kv_dtype,
            "source": source}  # the file's metadata: how the KV and the prompt's tokens were made
    if m.model.get("weights_digest"):
        meta["weights_digest"] = m.model["weights_digest"]
    data = safetensors_save(tensors, metadata=meta)
    atomic_write(output, lambda f: f.write(data))


def _check_memory(decoded: int) -> None:
    """Refuse, in one line, a selection that cannot fit in this machine's memory."""
    total = host_memory_bytes()
    if total is not None and decoded * DUMP_MEMORY_FACTOR > total:
        raise OutputError(f"dumping {decoded / 2**30:.1f} GiB of decoded KV needs about "
                          f"{decoded * DUMP_MEMORY_FACTOR / 2**30:.1f} GiB of memory; this machine has "
                          f"{total / 2**30:.1f}: select fewer --chunks or --layers")
