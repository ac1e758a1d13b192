"""Model identity: what a KV file records about the model that produced it.

The fingerprint is defined in format-spec/container.md ("Model fingerprint"):
SHA-256 over the canonical JSON of the fields below that change the KV values
(everything but `name`), so two runs of the same architecture and config share
it and a replay can refuse a file from a different model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelIdentity:
    name: str  # human label, e.g. "SmolLM2-135M-Instruct"; not fingerprinted
    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # {"rope_theta": float, "rope_scaling": dict | None}; kept as a dict so new
    # scaling schemes need no format change.
    rope: dict[str, Any] = field(default_factory=dict)
    # Extra hashed facts for stricter matching.
    extra: dict[str, Any] = field(default_factory=dict)
    # Which weights (format-spec/container.md §3.1): not fingerprinted, so a file records it
    # without changing what "the same model" means for files written before it existed.
    weights_digest: str | None = None

    def fingerprint(self) -> str:
        return model_fingerprint(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["weights_digest"] is None:
            del d["weights_digest"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelIdentity":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys, no whitespace, floats as Python repr."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


NOT_FINGERPRINTED = ("name", "fingerprint", "weights_digest")


def model_fingerprint(identity: dict[str, Any]) -> str:
    hashed = {k: v for k, v in identity.items() if k not in NOT_FINGERPRINTED}
    return "sha256:" + hashlib.sha256(canonical_json(hashed)).hexdigest()
