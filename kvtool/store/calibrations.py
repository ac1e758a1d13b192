"""pca calibration objects in the store (format-spec/store.md §4.7): the object a pca chunk names
by its SHA-256 travels beside the chunk, so a reader on another host decodes it without a file
copied by hand.

- a writer of pca chunks puts the object once, under `calibrations/<d[0:2]>/<d>.kvcal`, before
  the chunks that name it (`publish`: put-once, so the first writer's bytes stay; a writer that
  finds it there writes nothing);
- a reader that lacks the object locally fetches it by its digest (`fetch`, which
  `codecs.pca.calibration.find` calls while the store is open), checks that its bytes hash to
  the name (else the stored object is damage: refused and removed), and keeps it in its own
  calibration folder, so later loads need no fetch.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from ..codecs.pca import calibration as calmod
from ..errors import DecodeError, ObjectRefused, ObjectUnreadable, StoreAccessDenied, StoreError
from ..notices import notice
from .names import calibration_name

if TYPE_CHECKING:
    from .backend import Backend

#: How long a writer trusts that an object it put (or found) is still stored before it looks again:
#: an eviction (gc, Redis' maxmemory) may drop it, and the next writer then puts it back.
RECHECK_SECONDS = 60.0


def check(data: bytes, name: str, digest: str) -> None:
    """A calibration object's bytes hash to the digest its name holds and parse as one (pca.md §3);
    ObjectRefused otherwise."""
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise ObjectRefused(f"{name}: its bytes hash to {got[:16]}..., not the digest its name holds")
    try:
        calmod.from_bytes(data, expect_digest=digest)
    except DecodeError as err:
        raise ObjectRefused(f"{name}: {err}") from None


class CalibrationShelf:
    """The store's calibration objects for one open store: written once, fetched by digest."""

    def __init__(self, backend: "Backend"):
        self.backend = backend
        self.published: dict[str, float] = {}  # digest -> when it was last known to be stored
        fetch = weakref.WeakMethod(self.fetch)  # (a store dropped unclosed is not kept alive by it...
        self.source = calmod.add_source(f"the store {backend.url}",
                                        lambda digest: (fetch() or (lambda _digest: None))(digest))
        weakref.finalize(self, calmod.remove_source, self.source)  # ...nor listed after it is gone)

    def close(self) -> None:
        calmod.remove_source(self.source)

    def publish(self, digests: Iterable[str]) -> None:
        """Put each object (from this machine's calibration folders) unless it is stored already;
        put-once, so concurrent writers leave one object. Where this machine does not have it,
        the chunk's writer could not have coded the chunk: nothing to put."""
        now = time.monotonic()
        for digest in set(digests):
            if now - self.published.get(digest, -RECHECK_SECONDS) < RECHECK_SECONDS:
                continue
            name = calibration_name(digest)
            try:
                if not self.backend.exists_many([name])[0]:
                    self.backend.put_many([(name, calmod.object_bytes(digest))])
            except calmod.CalibrationNotFound:
                continue
            except StoreAccessDenied as err:  # (an ACL confined to a namespace): the chunks still go in
                notice(f"store: could not put calibration object {name} ({err}); hosts without it will miss "
                       "the pca chunks that name it", key="store calibration denied")
            self.published[digest] = now

    def fetch(self, digest: str) -> bytes | None:
        """The object named `digest` from the store, checked; None when it is not stored (or was
        damaged: then refused, said once, and removed so that the next writer puts it back)."""
        name = calibration_name(digest)
        try:
            data = self.backend.get(name)
        except (ObjectRefused, ObjectUnreadable, StoreError) as err:
            notice(f"store: calibration object {name} could not be read ({err})", key="store calibration")
            return None
        if data is None:
            return None
        data = bytes(data)
        try:
            check(data, name, digest)
        except ObjectRefused as err:
            notice(f"store: refused a damaged calibration object ({err}); removed", key="store calibration")
            self.backend.delete(name)
            return None
        self.published[digest] = time.monotonic()
        return data


def pca_digests(items: Iterable[tuple[str, dict[str, Any] | None]]) -> list[str]:
    """The calibration digests of (codec, params) pairs that are pca."""
    return [p["calibration"] for codec, p in items if codec == "pca" and p and isinstance(p.get("calibration"), str)]
