"""The connector's settings, read once from vLLM's `kv_connector_extra_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import codecs
from ...errors import KvtoolError, shown
from ...store.names import ExtraKeys


@dataclass(frozen=True)
class ConnectorConfig:
    store_url: str  # a folder, file://, redis://... (open_store's URL)
    codec: str  # raw | zstd | cachegen | pca: how saved chunks are encoded
    chunk_size: int  # tokens per stored chunk, a multiple of vLLM's block size
    block_size: int  # vLLM's block size (tokens)
    save_generated: bool  # also save whole chunks that generated tokens complete
    namespace: str  # the user's partition of a shared store ("" for none)
    lookup_wait_s: float  # how long the scheduler waits for a store lookup before asking again later
    role: str = "kv_both"  # vLLM's kv_role: kv_producer never loads, kv_consumer never saves
    params: dict[str, Any] | None = None  # the codec's parameters (None: its defaults); pca: its calibration

    @property
    def loads(self) -> bool:
        return self.role != "kv_producer"

    @property
    def saves(self) -> bool:
        return self.role != "kv_consumer"

    @property
    def saves_before_reply(self) -> bool:
        """A producer (prefill here, decode there): its step ends with the step's chunks stored,
        so the reply that step produces (the first token) leaves after them."""
        return self.role == "kv_producer"


def read_config(vllm_config) -> ConnectorConfig:
    """The settings from vLLM's config; a bad one is a ValueError of one line (vLLM refuses to start)."""
    extra = vllm_config.kv_transfer_config
    url = extra.get_from_extra_config("store", None)
    if not url:
        raise ValueError("KVToolConnector needs kv_connector_extra_config.store: a folder or redis://...")
    codec = extra.get_from_extra_config("codec", "raw")
    if codec not in codecs.codec_names():
        raise ValueError(f"KVToolConnector: unknown codec {codec!r} (one of {', '.join(codecs.codec_names())})")
    quality, calibration, bitstream = (extra.get_from_extra_config(key, None)
                                       for key in ("quality", "calibration", "bitstream"))
    if codec == "pca":
        params = pca_params(vllm_config.model_config.model, quality, calibration, bitstream)
    elif quality is not None or calibration is not None or bitstream is not None:
        given = [key for key, value in (("quality", quality), ("calibration", calibration), ("bitstream", bitstream))
                 if value is not None]
        raise ValueError(f"KVToolConnector: {' and '.join(given)}: the pca codec's keys (codec is {codec!r})")
    else:
        params = None
    if getattr(vllm_config.model_config.hf_text_config, "kv_lora_rank", None) is not None:
        from ...format.manifest import LATENT_CODECS

        if codec not in LATENT_CODECS:  # the latent's chunks are mla_latent ones (container.md 3.2)
            raise ValueError(f"KVToolConnector: codec {codec} codes K and V planes; this model caches a latent "
                             f"(multi-head latent attention): use codec {' or '.join(LATENT_CODECS)}")
    block_size = vllm_config.cache_config.block_size
    chunk_size = int(extra.get_from_extra_config("chunk_size", 256))
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(f"KVToolConnector: chunk_size {chunk_size} must be a multiple of vLLM's block size "
                         f"{block_size}")
    namespace = extra.get_from_extra_config("namespace", None) or ""
    try:  # the same checks a request's keys get: refused here, at start, not per request
        ExtraKeys(namespace=namespace)
    except KvtoolError as err:
        raise ValueError(f"KVToolConnector: {err}") from None
    wait_ms = float(extra.get_from_extra_config("lookup_wait_ms", 2.0))
    if wait_ms < 0:
        raise ValueError(f"KVToolConnector: lookup_wait_ms must be >= 0, got {wait_ms}")
    return ConnectorConfig(store_url=str(url), codec=codec, chunk_size=chunk_size, block_size=block_size,
                           save_generated=bool(extra.get_from_extra_config("save_generated", False)),
                           namespace=namespace, lookup_wait_s=wait_ms / 1e3, role=extra.kv_role or "kv_both",
                           params=params)


def pca_params(model_path: str, quality: Any, calibration: Any, bitstream: Any = None) -> dict[str, Any]:
    """pca's parameters for the served model: the named quality point (default 97) with the
    calibration object `calibration` names (a SHA-256 digest), or else the one `kvtool calibrate`
    registered for this model (by its fingerprint), in bitstream `bitstream` (format-spec/pca.md
    §11: 1, the default, or 2; a JSON number or its digits). The object must be here and fit the
    model's KV: a one-line ValueError otherwise, so that vLLM refuses to start, rather than every
    save failing later."""
    from ...codecs.pca import DEFAULT_QUALITY, QUALITY, bitstream_version, params_for
    from ...errors import CodecParamsInvalid
    from ...codecs.pca.calibration import find, for_model
    from ...engine.loader import model_identity

    # (--kv-transfer-config's JSON gives a number or a string: either is taken; not True, not 97.0)
    if quality is None:
        quality = DEFAULT_QUALITY
    elif type(quality) is int and quality.bit_length() < 64:
        quality = str(quality)
    if type(quality) is not str or quality not in QUALITY:
        raise ValueError(f"KVToolConnector: quality {shown(quality)} is not one of {', '.join(QUALITY)} (codec pca)")
    try:
        version = bitstream_version(bitstream)
    except CodecParamsInvalid:
        raise ValueError(f"KVToolConnector: bitstream {shown(bitstream)} is not 1 or 2 (codec pca)") from None
    try:
        identity = model_identity(model_path)
    except KvtoolError as err:
        raise ValueError(f"KVToolConnector: codec pca: {err}") from None
    digest = str(calibration) if calibration is not None else for_model(identity.fingerprint())
    if digest is None:
        raise ValueError(f"KVToolConnector: codec pca: no calibration object for {identity.name}; run `kvtool "
                         f"calibrate --model {model_path}` once on this machine, or give "
                         "kv_connector_extra_config.calibration (a digest)")
    try:
        cal = find(digest)
    except KvtoolError as err:
        raise ValueError(f"KVToolConnector: {err}") from None
    channels = identity.num_kv_heads * identity.head_dim
    if (cal.layers, cal.channels, cal.head_dim) != (identity.num_layers, channels, identity.head_dim):
        raise ValueError(f"KVToolConnector: calibration {digest[:16]}... is for {cal.layers} layers of {cal.channels} "
                         f"channels; {identity.name}'s KV is {identity.num_layers} layers of {channels}")
    return params_for(digest, quality, version=version)
