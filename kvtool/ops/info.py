"""`info`: versions, codecs, and the backends this install uses. Without `devices` it
imports no torch (versions come from package metadata); with it, it asks torch about CUDA."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

from .result import Result


@dataclass
class InfoResult(Result):
    kvtool: str
    torch: str
    writes_format: str
    reads_formats: list[str]
    codecs: list[dict[str, Any]]
    layouts: list[dict[str, Any]]  # the layout kinds this build reads and writes (container.md 3.2)
    backends: dict[str, str]
    threads: int
    default_model_installed: bool
    model_cache: str
    devices: dict[str, str] = field(default_factory=dict)


def info(*, devices: bool = False) -> InfoResult:
    from .. import codecs
    from ..codecs.cachegen import native_available
    from ..codecs.cachegen.native import default_threads
    from ..engine.default_model import default_model_installed
    from ..format import SUPPORTED_VERSIONS
    from ..format.layout import VERSION_MAJOR, VERSION_MINOR
    from ..format.manifest import LATENT_CODECS
    from ..fsutil import cache_root
    from ..version import __version__

    found = [codecs.get_codec(n) for n in codecs.codec_names()]
    backends = {"cachegen": (f"native C coder, {default_threads()} threads" if native_available()
                             else "pure-Python reference (native coder not built)"),
                "pca": _pca_backend(default_threads())}
    result = InfoResult(
        kvtool=__version__, torch=_version("torch"), writes_format=f"{VERSION_MAJOR}.{VERSION_MINOR}",
        reads_formats=list(SUPPORTED_VERSIONS),
        codecs=[{"name": c.name, "id": c.codec_id, "lossless": c.lossless, "params_version": c.params_version}
                for c in found],
        layouts=layout_kinds([c.name for c in found], list(LATENT_CODECS)),
        backends=backends, threads=default_threads(), default_model_installed=default_model_installed(),
        model_cache=str(cache_root()))
    if devices:
        result.devices = probe_devices()
    return result


def layout_kinds(all_codecs: list[str], latent_codecs: list[str]) -> list[dict[str, Any]]:
    """Each layout kind this build reads and writes, with the format version that brought it and
    the codecs its chunks may use."""
    from ..format.layout import LAYOUT_MINOR, VERSION_MAJOR

    what = {"kv_blob": "K and V per KV head and layer", "mla_latent": "one latent per token and layer (MLA)"}
    return [{"name": name, "since": f"{VERSION_MAJOR}.{minor}", "reads": True, "writes": True, "holds": what[name],
             "codecs": all_codecs if name == "kv_blob" else [c for c in latent_codecs if c in all_codecs]}
            for name, minor in LAYOUT_MINOR.items()]


_PCA_PATHS = {"avx512": "AVX-512 VNNI", "avx2": "AVX2", "portable": "portable C, no SIMD"}


def _pca_backend(threads: int) -> str:
    """The pca coder this process uses, and its widest code path (KVTOOL_PCA_SIMD can narrow it)."""
    from ..codecs.pca import native

    module = native.native_module(warn=False)
    if module is None:
        return "numpy reference (native coder not built)"
    return f"native C coder ({_PCA_PATHS.get(module.simd(), module.simd())}), {threads} threads"


def probe_devices() -> dict[str, str]:
    """Ask torch what it sees: the CUDA kernels' state and where `--device auto` runs."""
    from .. import cuda_build
    from ..devices import describe, resolve_device

    return {"paged copy": "fused CUDA kernel" if cuda_build.available() else "torch indexing (CPU)",
            "cuda": cuda_build.backend_status(),
            "engine": f"--device auto runs the model on {describe(resolve_device('auto'))}"}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
