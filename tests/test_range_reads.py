"""A container can be read with range requests only (object storage): the reader
opens it with exactly three reads and fetches each chunk with one more."""

from __future__ import annotations

import torch

from kvtool.format import ContainerReader, ContainerWriter, ModelIdentity


class CountingRangeSource:
    """Serves byte ranges from memory and records every request, as an HTTP client would."""

    def __init__(self, data: bytes, name: str = "s3://bucket/prompt.kvc"):
        self._data = data
        self.name = name
        self.size = len(data)
        self.requests: list[tuple[int, int]] = []

    def read(self, offset: int, length: int) -> bytes:
        self.requests.append((offset, length))
        return self._data[offset: offset + length]

    def close(self) -> None:
        pass


IDENTITY = ModelIdentity(name="tiny", architecture="LlamaForCausalLM", num_layers=3, num_attention_heads=4,
                         num_kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=64, vocab_size=100,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope={"rope_theta": 10000.0, "rope_scaling": None})


def _file(tmp_path) -> tuple[bytes, torch.Tensor]:
    kv = torch.randn(2, 3, 40, 16).to(torch.bfloat16)
    path = tmp_path / "r.kvc"
    with ContainerWriter(path, IDENTITY, list(range(40)), chunk_size=16) as w:
        for i, (s, e) in enumerate(w.chunk_ranges()):
            w.write_chunk(kv[:, :, s:e], ("raw", "zstd")[i % 2])
    return path.read_bytes(), kv


def test_open_needs_three_ranges_and_a_chunk_one_more(tmp_path):
    data, kv = _file(tmp_path)
    source = CountingRangeSource(data)
    reader = ContainerReader(source)
    assert len(source.requests) == 3
    header, trailer, manifest = source.requests
    assert header == (0, 64) and trailer == (len(data) - 32, 32)
    assert manifest[0] + manifest[1] == len(data) - 32
    chunk = reader.chunks[1]
    got = reader.read_chunk(1)
    assert source.requests[3:] == [(chunk.blob.offset, chunk.blob.length)]
    assert torch.equal(got, kv[:, :, 16:32])
    assert str(reader.path) == "s3://bucket/prompt.kvc"


def test_range_source_reads_whole_sequence_like_a_local_file(tmp_path):
    data, kv = _file(tmp_path)
    remote = ContainerReader(CountingRangeSource(data))
    local = ContainerReader(tmp_path / "r.kvc")
    assert torch.equal(remote.read_range(0, 40), local.read_range(0, 40))
    assert torch.equal(remote.read_range(0, 40), kv)
    assert remote.token_ids().tolist() == list(range(40))
