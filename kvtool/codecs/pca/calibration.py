"""The pca codec's calibration object: what it learns once per model (format-spec/pca.md §3).

Per part (K, V) and layer: a channel mean, a channel weight (the square root of how much an
error in that channel moves the model: the query energy that reads a key channel, the o_proj
column energy that reads a value channel), and an orthonormal basis of the weighted channels
(their principal axes, the largest first) stored as int16 in Q14. For K, the inverse RoPE
frequencies of each layer, because keys are coded as they were before RoPE (one basis then
serves every position).

The object is a safetensors file; its name is the SHA-256 of its bytes, which every chunk
coded with it records. A reader finds it by that digest (`find`), never by model name.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import CodecParamsInvalid, DecodeError

if TYPE_CHECKING:
    import torch

BASIS_ONE = 1 << 14  # Q14: a basis entry b is stored as round(b * 2^14)
FORMAT = "kvtool-pca-calibration/1"
SUFFIX = ".kvcal"
MAX_CHANNELS = 4096  # the integer sums of §5 stay exact below this (2^23 * 2^15 * 2^12 < 2^53)


WEIGHT_MIN, MEAN_MAX = 2.0 ** -96, 2.0 ** 100  # format-spec/pca.md §3: the inverse never overflows float32

class CalibrationNotFound(DecodeError):
    """A chunk names a calibration object this machine does not have."""


@dataclass(frozen=True)
class Calibration:
    mean: np.ndarray  # [2, L, C] float32: K then V
    weight: np.ndarray  # [2, L, C] float32, > 0
    basis: np.ndarray  # [2, L, C, C] int16: basis[p, l, c, k] = entry c of component k, Q14
    inv_freq: np.ndarray  # [L, D/2] float32: the frequencies layer l's keys were turned with
    head_dim: int
    model: str  # the model fingerprint it was learned on (informative: chunks name the digest)
    digest: str = ""  # SHA-256 of the file's bytes, hex; set by `load`/`save`

    @property
    def layers(self) -> int:
        return self.mean.shape[1]

    @property
    def channels(self) -> int:
        return self.mean.shape[2]

    def check(self) -> None:
        L, C, D = self.layers, self.channels, self.head_dim
        shapes = {"mean": (self.mean, (2, L, C), np.float32), "weight": (self.weight, (2, L, C), np.float32),
                  "basis": (self.basis, (2, L, C, C), np.int16), "inv_freq": (self.inv_freq, (L, D // 2), np.float32)}
        for name, (array, shape, dtype) in shapes.items():
            if array.shape != shape or array.dtype != dtype:
                raise DecodeError(f"pca calibration: {name} is {array.dtype}{list(array.shape)}, expected "
                                  f"{np.dtype(dtype)}{list(shape)}")
        if D < 2 or D % 2 or C % D or C > MAX_CHANNELS:
            raise DecodeError(f"pca calibration: {C} channels of head_dim {D} do not fit (at most {MAX_CHANNELS})")
        if not (np.isfinite(self.mean).all() and np.isfinite(self.weight).all() and (self.weight > 0).all()
                and np.isfinite(self.inv_freq).all()):
            raise DecodeError("pca calibration: a mean, weight or frequency is not finite (or a weight not > 0)")
        # so that nothing section 5.2 computes in float32 overflows: no infinity, so no NaN (pca.md §3)
        if (self.weight < WEIGHT_MIN).any() or (np.abs(self.mean) > MEAN_MAX).any():
            raise DecodeError("pca calibration: a weight below 2^-96 or a mean beyond 2^100 (pca.md §3)")
        if (self.basis == -32768).any():
            raise DecodeError("pca calibration: a basis entry is -32768 (entries are within +-32767)")

    # ---- files --------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The object as a safetensors file laid out one fixed way (format-spec/pca.md §3): the
        header's JSON compact, the metadata first, then the tensors in name order, padded with
        spaces to a multiple of 8. Its name is the digest of these bytes, so the same tensors must
        give the same bytes: the safetensors library writes its metadata keys in an order that
        changes from run to run (0.8.0), which named one calibration anew at every save."""
        tensors = {"basis": self.basis, "inv_freq": self.inv_freq, "mean": self.mean, "weight": self.weight}
        header: dict = {"__metadata__": {"format": FORMAT, "head_dim": str(self.head_dim), "model": self.model}}
        parts, at = [], 0
        for name, array in tensors.items():
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            header[name] = {"dtype": {"int16": "I16", "float32": "F32"}[array.dtype.name], "shape": list(array.shape),
                            "data_offsets": [at, at + len(raw)]}
            parts.append(raw)
            at += len(raw)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + b"".join(parts)

    def save(self, folder: str | os.PathLike) -> "Calibration":
        """Write `<digest>.kvcal` into `folder` (atomically) and return self with its digest."""
        from ...fsutil import atomic_write

        data = self.to_bytes()
        digest = hashlib.sha256(data).hexdigest()
        path = pathlib.Path(folder) / f"{digest}{SUFFIX}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: f.write(data))
        return Calibration(**{**self.__dict__, "digest": digest})


def from_bytes(data: bytes, expect_digest: str | None = None) -> Calibration:
    """Parse a calibration object; `expect_digest`: refuse bytes whose SHA-256 differs."""
    digest = hashlib.sha256(data).hexdigest()
    if expect_digest is not None and digest != expect_digest:
        raise DecodeError(f"pca calibration: its bytes hash to {digest[:16]}..., not {expect_digest[:16]}...")
    import json
    import struct

    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
        (n,) = struct.unpack_from("<Q", data, 0)  # the header holds the metadata load() drops
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    except (SafetensorError, ValueError, KeyError, struct.error) as err:
        raise DecodeError(f"pca calibration: not a calibration object ({err})") from None
    if meta.get("format") != FORMAT or set(tensors) != {"mean", "weight", "basis", "inv_freq"}:
        raise DecodeError(f"pca calibration: not a {FORMAT} object")
    head_dim = meta.get("head_dim")  # plain decimal digits (format-spec/pca.md §3): not int()'s "+64" or "6_4"
    if (not isinstance(head_dim, str) or not head_dim.isascii() or not head_dim.isdigit() or head_dim.startswith("0")
            or len(head_dim) > 4):  # (C <= 4096: so is D; and int() refuses 4,300 digits with a bare ValueError)
        raise DecodeError("pca calibration: no head_dim (a decimal number without sign or leading zeros)")
    head_dim = int(head_dim)
    cal = Calibration(mean=tensors["mean"], weight=tensors["weight"], basis=tensors["basis"],
                      inv_freq=tensors["inv_freq"], head_dim=head_dim, model=str(meta.get("model", "")), digest=digest)
    cal.check()
    return cal


def search_path() -> list[pathlib.Path]:
    """Where calibration objects are looked for, in order: $KVTOOL_CALIBRATION_PATH (folders
    separated by os.pathsep), then $KVTOOL_CALIBRATION_DIR or kvtool's cache folder's calibration/."""
    extra = [pathlib.Path(p) for p in os.environ.get("KVTOOL_CALIBRATION_PATH", "").split(os.pathsep) if p]
    return extra + [default_dir()]


def default_dir() -> pathlib.Path:
    from ...fsutil import cache_root

    env = os.environ.get("KVTOOL_CALIBRATION_DIR")
    return pathlib.Path(env) if env else cache_root() / "calibration"


_loaded: dict[str, Calibration] = {}
_bytes: dict[str, bytes] = {}  # digest -> the object's bytes as found (what a writer publishes or embeds)
_lock = threading.Lock()
_source_ids = itertools.count()

#: Where else an object may be fetched from, after the folders (format-spec/pca.md §3.1): each a
#: callable digest -> (its bytes or None, where it looked). The places that hold objects beside
#: the chunks that name them add themselves while open: a store (`store/calibrations.py`), a file
#: that carries its calibration. Keyed by an id so that each removes its own.
_sources: dict[int, tuple[str, Callable[[str], bytes | None]]] = {}


def add_source(where: str, fetch: Callable[[str], bytes | None]) -> int:
    """Let `find` fetch objects through `fetch` (after the folders); returns the id `remove_source` takes."""
    key = next(_source_ids)
    _sources[key] = (where, fetch)
    return key


def remove_source(key: int) -> None:
    _sources.pop(key, None)


def _check_digest(digest: str) -> None:
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CodecParamsInvalid("pca: 'calibration' must be a SHA-256 digest (64 lower-case hex digits)")


def find(digest: str) -> Calibration:
    """The calibration object named `digest`: from memory, the search path's folders, then the
    sources (a store, a file carrying it: checked by its digest, then kept in the cache folder so
    the next process finds it there); one line naming every place looked if absent."""
    _check_digest(digest)
    cal = _loaded.get(digest)
    if cal is not None:
        return cal
    with _lock:  # (loads decode on worker threads: one fetch of an object, not one each)
        cal = _loaded.get(digest)
        if cal is not None:
            return cal
        for folder in search_path():
            path = folder / f"{digest}{SUFFIX}"
            if path.is_file():
                return _keep(path.read_bytes(), digest, save=False)
        for _where, fetch in list(_sources.values()):
            data = fetch(digest)
            if data is not None:
                return _keep(bytes(data), digest, save=True)
    where = ", ".join([str(p) for p in search_path()] + [w for w, _ in _sources.values()])
    raise CalibrationNotFound(f"pca: calibration object {digest[:16]}... not found (looked in {where}); copy "
                              f"{digest}{SUFFIX} there or set KVTOOL_CALIBRATION_PATH")


def _keep(data: bytes, digest: str, save: bool) -> Calibration:
    """Parse and check `data` as the object `digest` (refused when its bytes hash otherwise), keep
    it in memory and, fetched from elsewhere, in the cache folder (best effort: a read-only cache
    folder leaves it in memory only)."""
    cal = from_bytes(data, expect_digest=digest)
    if save:
        from ...fsutil import atomic_write

        path = default_dir() / f"{digest}{SUFFIX}"
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, lambda f: f.write(data))
        except OSError:
            pass
    _bytes[digest] = data
    _loaded[digest] = cal
    return cal


def object_bytes(digest: str) -> bytes:
    """The bytes of the object named `digest` (found as `find` finds it): what a writer puts in a
    store or a file beside the chunks that name it. They hash to `digest`."""
    cal = find(digest)
    data = _bytes.get(digest)
    if data is None:  # remembered without a file (`remember`): its fixed layout, if that is its name
        data = cal.to_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise CalibrationNotFound(f"pca: calibration object {digest[:16]}... is known here only as tensors "
                                      "laid out another way; save it to a folder of the search path")
        _bytes[digest] = data
    return data


def blocks_per_head(basis: np.ndarray, head_dim: int) -> bool:
    """True when a basis [..., C, C] has several KV heads (C / D > 1) and is zero outside their
    D x D blocks (row c and column k of one head: c / D = k / D). One head at a time, so the
    test holds no [C, C] mask of the whole basis (110 MB for an 8B model)."""
    C, D = basis.shape[-1], head_dim
    if C <= D or C % D:
        return False
    heads = np.arange(C) // D
    return not any(basis[..., h * D:(h + 1) * D, :][..., heads != h].any() for h in range(C // D))


_axes: dict[str, str] = {}  # digest -> axes(): a scan of the whole basis (110 MB of mask for an 8B model)


def axes(cal: Calibration) -> str:
    """'head' when the layer has several KV heads and every row's basis is zero outside their
    D x D blocks (principal axes learned per KV head: `kvtool calibrate --basis head`, which the C
    coder multiplies block by block), else 'layer' (one set of axes over all of a layer's
    channels; with one KV head the two are the same, and the default's name is kept)."""
    known = _axes.get(cal.digest) if cal.digest else None
    if known is None:
        known = "head" if blocks_per_head(cal.basis, cal.head_dim) else "layer"
        if cal.digest:
            _axes[cal.digest] = known
    return known


def remember(cal: Calibration) -> Calibration:
    """Keep `cal` (with its digest) for `find` in this process, without a file."""
    if not cal.digest:
        data = cal.to_bytes()
        cal = Calibration(**{**cal.__dict__, "digest": hashlib.sha256(data).hexdigest()})
        _bytes[cal.digest] = data
    _loaded[cal.digest] = cal
    return cal


def rope_tables(cal: Calibration, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [L, tokens, D/2] float32 for positions start..start+tokens-1: each the float64
    cos/sin of float64(position) * float64(inv_freq), rounded to float32 (§5.2). Computed here
    once and handed to every coder (native and device ones too), so all use identical tables."""
    pos = np.arange(start, start + tokens, dtype=np.float64)
    angle = pos[None, :, None] * cal.inv_freq.astype(np.float64)[:, None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def from_torch(mean: "torch.Tensor", weight: "torch.Tensor", basis: "torch.Tensor", inv_freq: "torch.Tensor",
               head_dim: int, model: str) -> Calibration:
    """A calibration from float tensors (basis [2, L, C, C] orthonormal columns, float)."""
    q = np.rint(basis.double().numpy() * BASIS_ONE).clip(-32767, 32767).astype(np.int16)
    cal = Calibration(mean=mean.float().numpy().astype(np.float32), weight=weight.float().numpy().astype(np.float32),
                      basis=q, inv_freq=inv_freq.float().numpy().astype(np.float32), head_dim=head_dim, model=model)
    cal.check()
    return cal


# ---- which calibration a model uses by default ---------------------------------------------
INDEX = "index.json"  # {model fingerprint: digest}, beside the objects in the default folder


def for_model(fingerprint: str) -> str | None:
    """The digest `kvtool calibrate` last learned for this model on this machine, if any."""
    import json

    try:
        index = json.loads((default_dir() / INDEX).read_text())
    except (OSError, ValueError):
        return None
    digest = index.get(fingerprint) if isinstance(index, dict) else None
    return digest if isinstance(digest, str) else None


def register(fingerprint: str, digest: str) -> None:
    """Make `digest` this model's default calibration (the index is rewritten atomically)."""
    import json

    from ...fsutil import atomic_write

    path = default_dir() / INDEX
    try:
        index = json.loads(path.read_text())
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        index = {}
    index[fingerprint] = digest
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(json.dumps(index, indent=1, sort_keys=True).encode()))
