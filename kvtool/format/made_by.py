"""Whether a container's KV was made by a given model (format-spec/container.md §3.1): the one
check every engine runs before a file's KV goes into its cache (kvtool's runner, transformers).

Only the model's identity is needed, so the check is the same whichever engine loads the KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ModelMismatch, NotAPrefixCache, PromptError
from ..identity import ModelIdentity

if TYPE_CHECKING:
    from .reader import ContainerReader

#: what a refusal of other weights tells the user to do (the CLI's flag; the Python API says its own)
OTHER_WEIGHTS_HINT = "--allow-other-weights to replay it anyway"


def check_made_by(reader: "ContainerReader", identity: ModelIdentity, *, allow_other_weights: bool = False,
                  other_weights_hint: str = OTHER_WEIGHTS_HINT) -> str:
    """The file was made by the model of `identity`: a prefix cache (a segment's keys rotated
    elsewhere are not), the same fingerprint, the same weights when the file records their digest,
    and (since a fingerprint is only a claim) KV of this model's shape and token ids inside its
    vocabulary. Returns what was found of the weights, for a report."""
    segment = reader.segment  # segment.md §1: a prefix consumer refuses keys rotated elsewhere
    if segment is not None and segment.stored_start != 0:
        raise NotAPrefixCache(f"{reader.path}: a segment whose keys are rotated for positions from "
                              f"{segment.stored_start}, not a prefix cache: blend it (replay --blend) instead")
    if reader.fingerprint != identity.fingerprint():
        raise ModelMismatch(
            f"{reader.path} was made by {reader.model.get('name')!r} ({reader.fingerprint[:19]}...), "
            f"not by the loaded model {identity.name!r} ({identity.fingerprint()[:19]}...)")
    m, channels = reader.manifest, identity.num_kv_heads * identity.head_dim
    if (m.num_layers, m.hidden_kv) != (identity.num_layers, channels):
        raise ModelMismatch(f"{reader.path} holds {m.num_layers} layers x {m.hidden_kv} KV channels, the model "
                            f"has {identity.num_layers} x {channels} (its fingerprint is forged)")
    check_vocabulary(reader.token_ids(), identity.vocab_size, where=f"{reader.path}: ")
    recorded, loaded = reader.model.get("weights_digest"), identity.weights_digest
    if recorded is None or loaded is None:
        return "not recorded in the file"
    if recorded == loaded:
        return "same weights"
    if not allow_other_weights:
        raise ModelMismatch(f"{reader.path} was computed with other weights than the loaded model's: "
                            f"{reader.model.get('name')!r} {recorded[:19]}... vs {identity.name!r} {loaded[:19]}... "
                            f"({other_weights_hint})")
    return "other weights (allowed by --allow-other-weights)"


def check_vocabulary(token_ids, vocab_size: int | None, where: str = "") -> None:
    """PromptError naming the first token id outside [0, vocab_size) (no check without a size)."""
    if not isinstance(vocab_size, int):
        return
    import numpy as np  # (here: a request checks its options before numpy loads)

    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise PromptError(f"{where}token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size})")


__all__ = ["OTHER_WEIGHTS_HINT", "check_made_by", "check_vocabulary"]
