"""kvtool.integrations.engine_blocks: the vLLM connector's worker-side copies, without vLLM. Every
layout the connector may name round-trips through a request's block ids; on a GPU the fused
kernels give the same tensors as the CPU. The layout is always given, never read off the tensors."""

from __future__ import annotations

import pytest
import torch

from kvtool.integrations.engine_blocks import EngineBlocks, SaveBuffers, UnsupportedKVLayout, checked_layout

L, H, D, NB, BS = 3, 2, 8, 12, 16
SHAPES = {"vllm_cpu": (NB, H, BS, 2 * D), "vllm": (NB, H, BS, 2 * D), "flash_attn": (2, NB, BS, H, D),
          "flashinfer": (NB, 2, BS, H, D)}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def engine(layout: str, device: str) -> list[torch.Tensor]:
    return [torch.zeros(SHAPES[layout], device=device) for _ in range(L)]


def write(blocks: EngineBlocks, kv: torch.Tensor, block_ids: list[int], start: int) -> None:
    """Tokens [start, start + T) of a request into its blocks, as a user puts them: through the
    blocks' load destination (`target`), its `scatter` of a KV_BLOB."""
    end = start + kv.shape[2]
    blocks.target(block_ids, end).scatter(kv.contiguous(), start, end)


def test_write_and_scatter_into_are_deprecated_for_target():
    blocks = EngineBlocks(engine("flash_attn", "cpu"), BS, "flash_attn")
    kv = torch.randn(2, L, 20, H * D)
    with pytest.warns(DeprecationWarning, match=r"EngineBlocks.target\(block_ids, end\).scatter"):
        blocks.write(kv[:, :, 4:], [3, 1], 4)
    assert torch.equal(blocks.read([3, 1], 4, 20), kv[:, :, 4:])
    with pytest.warns(DeprecationWarning, match="use EngineBlocks.target"):
        assert blocks.scatter_into([3, 1], 20).kwargs["slot_mapping"].tolist() == blocks.slots([3, 1], 20).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm", "flash_attn", "flashinfer"])
def test_tokens_round_trip_through_a_requests_blocks(layout, device):
    if layout == "vllm_cpu" and device == "cuda":
        pytest.skip("vLLM's CPU layout lives in host memory")
    blocks = EngineBlocks(engine(layout, device), BS, layout)
    assert blocks.layout.value == layout
    block_ids = [7, 2, 9, 0, 5]  # a request's blocks, in token order, not in memory order
    kv = torch.randn(2, L, 70, H * D)
    write(blocks, kv[:, :, :40], block_ids, 0)
    write(blocks, kv[:, :, 40:], block_ids, 40)  # a later step continues where the first stopped
    assert torch.equal(blocks.read(block_ids, 0, 70), kv)
    assert torch.equal(blocks.read(block_ids, 33, 51), kv[:, :, 33:51])
    untouched = [b for b in range(NB) if b not in block_ids]
    assert torch.equal(blocks.read(untouched, 0, BS * len(untouched)), torch.zeros(2, L, BS * len(untouched), H * D))


def test_tokens_round_trip_through_vllms_amx_pages():
    """vLLM's bfloat16 pages on an AMX CPU ("vllm_cpu_amx": block size and head dim multiples
    of 32) round-trip a request's tokens through its blocks like every other layout."""
    blocks = EngineBlocks([torch.zeros(6, 2, 32, 64, dtype=torch.bfloat16) for _ in range(L)], 32, "vllm_cpu_amx")
    assert blocks.layout.value == "vllm_cpu_amx"
    block_ids = [4, 1, 5]
    kv = torch.randn(2, L, 90, 2 * 32).to(torch.bfloat16)
    write(blocks, kv[:, :, :50], block_ids, 0)
    write(blocks, kv[:, :, 50:], block_ids, 50)
    assert torch.equal(blocks.read(block_ids, 0, 90), kv)
    assert not blocks.read([0, 2, 3], 0, 96).any()  # other blocks untouched
    with pytest.raises(UnsupportedKVLayout, match="multiples of 32"):
        EngineBlocks([torch.zeros(6, 2, 16, 64, dtype=torch.bfloat16)], 16, "vllm_cpu_amx")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_attn"])
def test_a_save_reads_into_a_recycled_buffer(layout, device):
    """A save gathers into a buffer an earlier save gave back (the whole of it, though that save
    used a smaller view), with the same result as into a new tensor; a buffer too small, of
    another dtype, or not given back is not used."""
    if layout == "vllm_cpu" and device == "cuda":
        pytest.skip("vLLM's CPU layout lives in host memory")
    blocks = EngineBlocks(engine(layout, device), BS, layout)
    block_ids = [7, 2, 9, 0, 5]
    kv = torch.randn(2, L, 70, H * D)
    write(blocks, kv, block_ids, 0)
    buffers = SaveBuffers(keep=2)
    first = blocks.read(block_ids, 0, 30)
    buffers.give(blocks.read(block_ids, 0, 64)[:, :, :16])  # a view of part of it: the whole comes back
    assert buffers.take(10**9, torch.float32) is None and buffers.take(1, torch.float16) is None
    into = buffers.take(2 * L * 64 * H * D, torch.float32)
    assert into is not None and buffers.take(1, torch.float32) is None  # taken: no one else gets it
    again = blocks.read(block_ids, 0, 30, into=into)
    assert again.data_ptr() == into.data_ptr() and torch.equal(again, first)
    assert torch.equal(blocks.read(block_ids, 33, 51, into=torch.empty(5)), kv[:, :, 33:51])  # too small: a new one
    for _ in range(3):
        buffers.give(torch.empty(8))
    assert sum(buffers.take(1, torch.float32) is not None for _ in range(3)) == 2  # at most `keep` are kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_the_gpu_copies_leave_the_same_buffers_as_the_cpu(layout):
    kv = torch.randn(2, L, 50, H * D)
    cpu, gpu = EngineBlocks(engine(layout, "cpu"), BS, layout), EngineBlocks(engine(layout, "cuda"), BS, layout)
    for blocks in (cpu, gpu):
        write(blocks, kv, [3, 1, 10, 4], 0)
    for a, b in zip(cpu.layers, gpu.layers):
        assert torch.equal(a, b.cpu())


def test_an_unknown_layout_is_refused_in_one_line():
    """A layout kvtool does not know, or tensors that do not fit the one declared: one line each."""
    with pytest.raises(UnsupportedKVLayout, match="unknown paged layout 'lbhnc'") as err:
        checked_layout(torch.zeros(NB, H, BS, 2 * D), "lbhnc")
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedKVLayout, match="do not fit kvtool layout 'flash_attn'"):
        EngineBlocks(engine("vllm_cpu", "cpu"), BS, "flash_attn")
    with pytest.raises(UnsupportedKVLayout, match="do not fit kvtool layout 'vllm_cpu'"):
        EngineBlocks([torch.zeros(4, 4, 4)], BS, "vllm_cpu")


def test_the_vllm_layout_follows_the_tensors_strides():
    """vLLM 0.32 hands every layout as a [NB, H, BS, 2D] view whose strides carry its KV cache layout
    (LBNHC: tokens outside heads in memory); kvtool's copies follow the strides: K of head h of a
    token is the first D channels of its row, V the last D."""
    physical = torch.zeros(NB, BS, H, 2 * D)  # LBNHC's memory order
    view = physical.permute(0, 2, 1, 3)
    blocks = EngineBlocks([view] * L, BS, "vllm")
    kv = torch.randn(2, L, 40, H * D)
    block_ids = [3, 8, 1]
    write(blocks, kv, block_ids, 0)
    token, head = 21, 1  # in block_ids[1] = 8 at offset 5
    assert torch.equal(physical[8, 5, head, :D], kv[0, L - 1, token].view(H, D)[head])
    assert torch.equal(physical[8, 5, head, D:], kv[1, L - 1, token].view(H, D)[head])
    assert torch.equal(blocks.read(block_ids, 0, 40)[:, L - 1], kv[:, L - 1])


def test_the_store_loads_into_a_requests_blocks_from_a_token_on(tmp_path):
    """The vLLM connector's load: ModelCache.load_prefix through EngineBlocks.target, from
    the first token vLLM does not hold; its own blocks before that are never written."""
    from fixtures import make_identity
    from kvtool.store import open_store

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(500, 564))
    kv = torch.randn(2, L, 64, H * D)
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=32)
    cache.put_sequence(tokens, kv)
    blocks = EngineBlocks(engine("vllm_cpu", "cpu"), BS, "vllm_cpu")
    block_ids = [9, 4, 0, 11]
    hit = cache.load_prefix(tokens, blocks.target(block_ids, 64), max_tokens=64, from_token=BS)
    assert hit.num_tokens == 64
    assert torch.equal(blocks.read(block_ids, BS, 64), kv[:, :, BS:])
    assert not blocks.read(block_ids, 0, BS).any()


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["vllm", "flash_attn", "flashinfer"])
def test_the_store_loads_into_a_requests_blocks_on_every_device_alike(tmp_path, layout, device, codec):
    """The vLLM worker's load on a GPU (the staged path, or CacheGen decoded on the GPU) leaves
    the request's blocks holding exactly what the same load leaves on the CPU."""
    from fixtures import make_identity
    from kvtool.store import open_store

    identity = make_identity(num_layers=L, num_kv_heads=H, head_dim=D)
    tokens = list(range(900, 964))
    cache = open_store(tmp_path / "store").for_model(identity, chunk_size=32)
    cache.put_sequence(tokens, torch.randn(2, L, 64, H * D), codec=codec)
    block_ids = [9, 4, 0, 11]
    loaded = []
    for where in ("cpu", device):
        blocks = EngineBlocks(engine(layout, where), BS, layout)
        hit = cache.load_prefix(tokens, blocks.target(block_ids, 64), max_tokens=64, from_token=BS)
        assert hit.num_tokens == 64 and hit.codecs == [codec] * 2
        loaded.append(blocks.read(block_ids, 0, 64).cpu())
        assert not loaded[-1][:, :, :BS].any()
    assert torch.equal(loaded[0], loaded[1])


def test_latent_pages_round_trip_through_a_requests_blocks():
    """MLA's pages (vLLM's CPU_MLA: [NB, BS, W] a layer, a token's latent the row of its slot):
    an mla_latent chunk [1, L, T, W] in through `target`, out through `read`, exactly; the other
    blocks, and the tokens before the load's start, untouched."""
    from kvtool.integrations.engine_blocks import LatentBlocks

    width = 576
    layers = [torch.zeros(NB, BS, width) for _ in range(L)]
    blocks = LatentBlocks(layers, BS)
    latent = torch.randn(1, L, 40, width, generator=torch.Generator().manual_seed(0))
    block_ids = [7, 2, 9]  # tokens 0..15 in block 7, 16..31 in block 2, 32..39 in block 9
    blocks.target(block_ids, 40).scatter(latent[:, :, 16:].contiguous(), 16, 40)
    assert torch.equal(blocks.read(block_ids, 16, 40), latent[:, :, 16:])
    assert torch.equal(layers[1][2, 5], latent[0, 1, 21])  # token 21: block 2, row 5, as vLLM's cache write puts it
    assert not layers[0][7].any() and not layers[2][0].any()  # before the start, and others' blocks: untouched
    as_vllm_hands_them = LatentBlocks([t[:, None] for t in layers], BS)  # [NB, 1, BS, W]: vLLM's CPU worker's view
    assert torch.equal(as_vllm_hands_them.read(block_ids, 16, 40), latent[:, :, 16:])
    recycled = torch.empty(2 * L * 40 * width)
    got = blocks.read(block_ids, 16, 40, into=recycled)
    assert got.data_ptr() == recycled.data_ptr() and torch.equal(got, latent[:, :, 16:])


def test_latent_pages_of_another_shape_are_refused_in_one_line():
    from kvtool.integrations.engine_blocks import LatentBlocks

    with pytest.raises(UnsupportedKVLayout, match=r"latent pages must be \[blocks, 16, width\]"):
        LatentBlocks([torch.zeros(NB, H, BS, 2 * D)], BS)
