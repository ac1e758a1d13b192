"""`kvtool dump FILE -o OUT.safetensors|OUT.npy`: export decoded KV.

safetensors output holds, for the selected tokens T and each selected layer i:
  layers.{i}.key    [T, num_kv_heads, head_dim]   (KV dtype)
  layers.{i}.value  [T, num_kv_heads, head_dim]
  token_ids         [T] int64
  positions         [T] int64   (position of each exported token in the sequence)
and the model name, fingerprint and source path in the metadata.
.npy output holds one KV_BLOB array [2, layers, T, kv_heads * head_dim]; bf16 is
widened to float32 (numpy has no bfloat16; the widening is exact).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from rich.console import Console
from safetensors.torch import save as safetensors_save

from ..errors import OutputError, UsageError
from ..format import ContainerReader
from ..fsutil import atomic_write
from .options import ChunksOpt, InputPath, JsonOpt, LayersOpt, OutputPath, parse_index_set
from .output import emit, human_bytes


# dump holds the decoded selection about three times (chunks, their concatenation, the serialised
# output); a small file may declare up to 1024x its size in KV (format-spec limits)
DUMP_MEMORY_FACTOR = 3


def _check_memory(decoded: int) -> None:
    """Refuse, in one line, a selection that cannot fit in this machine's memory."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if decoded * DUMP_MEMORY_FACTOR > total:
        raise OutputError(f"dumping {decoded / 2**30:.1f} GiB of decoded KV needs about "
                          f"{decoded * DUMP_MEMORY_FACTOR / 2**30:.1f} GiB of memory; this machine has "
                          f"{total / 2**30:.1f}: select fewer --chunks or --layers")


def dump_command(path: InputPath, output: OutputPath, chunks: ChunksOpt = None,
                 layers: LayersOpt = None, json: JsonOpt = False) -> None:
    """Export decoded KV to safetensors (one tensor per layer and K/V) or .npy."""
    suffix = output.suffix.lower()
    if suffix not in (".safetensors", ".npy"):
        raise UsageError(f"output must end in .safetensors or .npy, got {output.name!r}")
    with ContainerReader(path) as reader:
        m = reader.manifest
        chunk_ids = parse_index_set(chunks, len(m.chunks), "chunks")
        layer_ids = parse_index_set(layers, m.num_layers, "layers")
        _check_memory(sum(m.chunks[i].decoded_bytes for i in chunk_ids) * len(layer_ids) // m.num_layers)
        parts = [reader.read_chunk(i)[:, layer_ids] for i in chunk_ids]  # each [2, L', T_i, C]
        kv = torch.cat(parts, dim=2)
        positions = torch.cat([torch.arange(m.chunks[i].start, m.chunks[i].end) for i in chunk_ids])
        token_ids = torch.from_numpy(reader.token_ids())[positions]
        if suffix == ".safetensors":
            tensors = {"token_ids": token_ids, "positions": positions}
            per_token = kv.view(2, len(layer_ids), kv.shape[2], m.num_kv_heads, m.head_dim)  # [2, L', T, H, D]
            for j, layer in enumerate(layer_ids):
                tensors[f"layers.{layer}.key"] = per_token[0, j].contiguous()
                tensors[f"layers.{layer}.value"] = per_token[1, j].contiguous()
            meta = {"model": m.model["name"], "fingerprint": m.model["fingerprint"],
                    "kv_dtype": m.kv_dtype, "source": str(path)}
            data = safetensors_save(tensors, metadata=meta)
            atomic_write(output, lambda f: f.write(data))
        else:
            array = kv.float().numpy() if kv.dtype == torch.bfloat16 else kv.numpy()
            atomic_write(output, lambda f: np.save(f, array))
    result: dict[str, Any] = {"output": str(output), "format": suffix[1:], "chunks": chunk_ids,
                              "layers": layer_ids, "num_tokens": int(kv.shape[2]),
                              "bytes": output.stat().st_size}
    emit(result, json, _render)


def _render(console: Console, r: dict[str, Any]) -> None:
    console.print(f"wrote {r['output']} ({r['format']}, {human_bytes(r['bytes'])}): "
                  f"{r['num_tokens']} tokens from {len(r['chunks'])} chunk(s), {len(r['layers'])} layer(s)")
