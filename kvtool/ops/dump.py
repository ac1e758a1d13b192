"""`dump`: export decoded KV to safetensors or .npy.

safetensors output holds, for the selected tokens T and each selected layer i:
  layers.{i}.key    [T, num_kv_heads, head_dim]   (KV dtype)
  layers.{i}.value  [T, num_kv_heads, head_dim]
  or, for an mla_latent file (container.md 3.2), in their place:
  layers.{i}.latent [T, kv_lora_rank + rope_dim]  (the latent, then the rotated key part; the
                    metadata's kv_lora_rank and rope_dim say where one ends)
  token_ids         [T] int64
  positions         [T] int64   (position of each exported token in the sequence)
  hidden_states     [T, hidden]  (when the file has them; their dtype)
  roi_mask          [T] bool     (when the file has one)
and in the metadata the model's name, fingerprint and weights digest, the source path, and the
file's own metadata (how its KV was computed, how its prompt became tokens: the prompt format,
the chat template's digest, add_generation_prompt), which a reader needs to rebuild the input.
.npy output holds one KV_BLOB array [2, layers, T, kv_heads * head_dim] ([1, layers, T,
kv_lora_rank + rope_dim] for an mla_latent file); bf16 is
widened to float32 (numpy has no bfloat16; the widening is exact). What it holds is
said beside it, in OUT.npy.json: the source, model, fingerprint, weights digest, KV dtype, the
file's metadata, the layers and chunks selected (axis 1 and 2 of the array), each token's position and id;
the file's extras at the same tokens go to OUT.hidden_states.npy and OUT.roi_mask.npy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..devices import host_memory_bytes
from ..dtypes import NUMPY_STORAGE, bfloat16_to_float32, itemsize
from ..errors import OutputError
from ..format import ContainerReader
from ..fsutil import atomic_write
from .file_requests import DumpRequest
from .inputs import parse_index_set
from .result import Result
from .windows import WINDOW_VALUES

# dump holds one decoded chunk at a time, writing each out as it is decoded, beside a window of
# its values widened for .npy: at most twice the largest selected chunk (format-spec/container.md
# §5, memory); a small file may declare up to 1024x its size in KV (format-spec limits)
DUMP_MEMORY_FACTOR = 2

#: safetensors lays its tensors out by dtype, the widest first (its `Dtype` order, which the
#: library sorts by, descending), then by name; a streamed file keeps that layout.
SAFETENSORS_DTYPES = {"int64": ("I64", 5), "float64": ("F64", 4), "float32": ("F32", 3),
                      "bfloat16": ("BF16", 2), "float16": ("F16", 1), "bool": ("BOOL", 0)}


@dataclass
class DumpResult(Result):
    output: str
    format: str
    chunks: list[int]
    layers: list[int]
    num_tokens: int
    bytes: int
    sidecar: str | None = field(default=None)  # .npy: what the array holds, as JSON


def dump(path: str | Path | DumpRequest, output: str | Path | None = None, *,
         on_chunk: Callable[[int, int], None] | None = None, **options: Any) -> DumpResult:
    """Export the selected chunks and layers ('0-3,7' forms; default all) of a file, with the
    file's extras (hidden states, region-of-interest mask) at the selected tokens: a `DumpRequest`,
    or its fields; `on_chunk(done, total)` reports progress. Chunks are decoded one at a time and
    written straight to their places in the output."""
    request = path if isinstance(path, DumpRequest) else DumpRequest(path, output, **options)
    path, output, chunks, layers = request.path, Path(request.output), request.chunks, request.layers
    suffix = output.suffix.lower()
    with ContainerReader(path) as reader:
        m = reader.manifest
        chunk_ids = parse_index_set(chunks, len(m.chunks), "chunks")
        layer_ids = parse_index_set(layers, m.num_layers, "layers")
        positions = np.concatenate([np.arange(m.chunks[i].start, m.chunks[i].end) for i in chunk_ids])
        _check_memory(max(m.chunks[i].decoded_bytes for i in chunk_ids),
                      sum(len(positions) * math.prod(e.shape[1:]) * _value_bytes(e.dtype) for e in m.extras.values()))
        token_ids = reader.token_ids()[positions]
        extras = {name: reader.read_extra_array(name)[positions] for name in m.extras}  # at the selected tokens
        selection = _Selection(reader, chunk_ids, layer_ids, len(positions), on_chunk)
        if suffix == ".safetensors":
            _write_safetensors(output, selection, token_ids, positions, extras, m, str(path))
            return DumpResult(output=str(output), format="safetensors", chunks=chunk_ids, layers=layer_ids,
                              num_tokens=len(positions), bytes=output.stat().st_size)
        sidecar = _write_npy(output, selection, token_ids, positions, extras, m, str(path))
    return DumpResult(output=str(output), format="npy", chunks=chunk_ids, layers=layer_ids,
                      num_tokens=len(positions), bytes=output.stat().st_size, sidecar=str(sidecar))


@dataclass
class _Selection:
    """The chunks and layers a dump exports, decoded one chunk at a time."""
    reader: ContainerReader
    chunk_ids: list[int]
    layer_ids: list[int]
    num_tokens: int
    on_chunk: Callable[[int, int], None] | None

    def slabs(self):
        """(kind 0/1 for K/V, j: the layer's place in the selection, first token in the selection,
        [T_i, C] values of chunk i) for every selected chunk and layer, a chunk decoded at a time."""
        first = 0
        for done, i in enumerate(self.chunk_ids, 1):
            kv = self.reader.read_chunk_array(i)  # [P, L, T_i, C] (P: 2, or 1 for a latent); kv[kind, layer] is contiguous
            for j, layer in enumerate(self.layer_ids):
                for kind in range(kv.shape[0]):
                    yield kind, j, first, kv[kind, layer]
            first += kv.shape[2]
            del kv  # (not held while the next chunk decodes)
            if self.on_chunk is not None:
                self.on_chunk(done, len(self.chunk_ids))


def _write_npy(output: Path, selection: _Selection, token_ids: np.ndarray, positions: np.ndarray,
               extras: dict[str, np.ndarray], m, source: str) -> Path:
    """OUT.npy, each extra as OUT.NAME.npy, and OUT.npy.json saying what they hold."""
    def numpy_values(array: np.ndarray, dtype: str) -> np.ndarray:  # numpy has no bfloat16: widen, bit for bit
        return bfloat16_to_float32(array) if dtype == "bfloat16" else array

    array_dtype = np.dtype(np.float32) if m.kv_dtype == "bfloat16" else NUMPY_STORAGE[m.kv_dtype]
    layers, channels, tokens = len(selection.layer_ids), m.hidden_kv, selection.num_tokens

    def write(f) -> None:  # the header np.save writes, then each slab at its place in [2, L', T, C]
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(array_dtype),
                                                 "fortran_order": False, "shape": (m.planes, layers, tokens, channels)})
        data_at = f.tell()
        for kind, j, first, slab in selection.slabs():
            f.seek(data_at + ((kind * layers + j) * tokens + first) * channels * array_dtype.itemsize)
            rows = max(1, WINDOW_VALUES // channels)  # widened a window at a time
            for row in range(0, slab.shape[0], rows):
                f.write(numpy_values(slab[row:row + rows], m.kv_dtype).astype(array_dtype, copy=False).data)
        f.truncate(data_at + m.planes * layers * tokens * channels * array_dtype.itemsize)  # (no selection: no slabs)

    atomic_write(output, write)  # first: it decodes the chunks, and a chunk that fails leaves no file behind
    written = {}
    for name, values in extras.items():
        extra_path = output.with_name(f"{output.stem}.{name}.npy")
        array = values if values.dtype == np.bool_ else numpy_values(values, m.extras[name].dtype)
        atomic_write(extra_path, lambda f, a=array: np.save(f, a))
        written[name] = {"file": extra_path.name, "dtype": m.extras[name].dtype, "array_dtype": str(array.dtype)}
    about = {"source": source, "model": m.model["name"], "fingerprint": m.model["fingerprint"],
             "weights_digest": m.model.get("weights_digest"), "metadata": m.metadata, "kv_dtype": m.kv_dtype, "array_dtype": str(array_dtype),
             "shape": _npy_shape_words(m), "kv_layout": m.kv_layout, "layers": selection.layer_ids,
             "chunks": selection.chunk_ids,
             "positions": positions.tolist(), "token_ids": token_ids.tolist(), "extras": written}
    sidecar = Path(f"{output}.json")
    atomic_write(sidecar, lambda f: f.write(json.dumps(about, indent=1).encode()))
    return sidecar


def _write_safetensors(output: Path, selection: _Selection, token_ids: np.ndarray, positions: np.ndarray,
                       extras: dict[str, np.ndarray], m, source: str) -> None:
    """The file `safetensors.torch.save` writes (its header, its layout, the same bytes but for the
    order of the metadata's keys, which safetensors does not keep), streamed: the header from the
    shapes, the small tensors, then each chunk's K and V of each layer at their places."""
    tokens = selection.num_tokens
    small = {"token_ids": (token_ids.astype(np.int64), "int64"), "positions": (positions.astype(np.int64), "int64")}
    for name, values in extras.items():  # hidden_states [T, E] in its dtype, roi_mask [T] bool
        small[name] = (np.ascontiguousarray(values), "bool" if values.dtype == np.bool_ else m.extras[name].dtype)
    entries = {name: (dtype, list(values.shape)) for name, (values, dtype) in small.items()}
    kinds = _tensor_kinds(m)
    for layer in selection.layer_ids:
        for kind in kinds:
            shape = [tokens, m.hidden_kv] if kind == "latent" else [tokens, m.num_kv_heads, m.head_dim]
            entries[f"layers.{layer}.{kind}"] = (m.kv_dtype, shape)
    order = sorted(entries, key=lambda name: (-SAFETENSORS_DTYPES[entries[name][0]][1], name))
    header: dict = {"__metadata__": _safetensors_metadata(m, source)}
    offsets, at = {}, 0
    for name in order:
        dtype, shape = entries[name]
        size = math.prod(shape) * _value_bytes(dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype][0], "shape": shape, "data_offsets": [at, at + size]}
        offsets[name], at = at, at + size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces to 8 bytes
    data_at = 8 + len(text)
    row_bytes = m.hidden_kv * itemsize(m.kv_dtype)

    def write(f) -> None:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, (values, _) in small.items():
            f.seek(data_at + offsets[name])
            f.write(values.data)
        for kind, j, first, slab in selection.slabs():
            name = f"layers.{selection.layer_ids[j]}.{kinds[kind]}"
            f.seek(data_at + offsets[name] + first * row_bytes)
            f.write(slab.data)  # [T_i, C] = [T_i, H, D] row-major: channel-major heads, as the tensor's view
        f.truncate(data_at + at)

    atomic_write(output, write)


def _tensor_kinds(m) -> tuple[str, ...]:
    """The safetensors names of a layer's planes: key and value, or an mla_latent file's latent."""
    return ("key", "value") if m.planes == 2 else ("latent",)


def _npy_shape_words(m) -> str:
    if m.planes == 2:
        return "[2 (K, V), layers, tokens, kv_heads * head_dim]"
    return "[1 (the latent), layers, tokens, kv_lora_rank + rope_dim]"


def _value_bytes(dtype: str) -> int:
    """Bytes per value of a KV dtype, or of the token ids' and the mask's."""
    return {"int64": 8, "bool": 1}.get(dtype) or itemsize(dtype)


def _safetensors_metadata(m, source: str) -> dict[str, str]:
    meta = {**m.metadata, "model": m.model["name"], "fingerprint": m.model["fingerprint"], "kv_dtype": m.kv_dtype,
            "source": source}  # the file's metadata: how the KV and the prompt's tokens were made
    if m.model.get("weights_digest"):
        meta["weights_digest"] = m.model["weights_digest"]
    if m.latent is not None:  # where a layer's latent ends and its rotated key part begins
        meta.update(kv_layout=m.kv_layout, **{key: str(value) for key, value in m.latent.items()})
    return meta


def _check_memory(largest_chunk: int, extras: int) -> None:
    """Refuse, in one line, a selection that cannot fit in this machine's memory: its largest chunk,
    decoded, and the extras at its tokens."""
    total = host_memory_bytes()
    needed = largest_chunk * DUMP_MEMORY_FACTOR + extras
    if total is not None and needed > total:
        raise OutputError(f"dumping a chunk of {largest_chunk / 2**30:.1f} GiB of decoded KV needs about "
                          f"{needed / 2**30:.1f} GiB of memory; this machine has "
                          f"{total / 2**30:.1f}: select fewer --chunks")
