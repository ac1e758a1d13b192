"""`kvtool info`: versions, codecs, and which backends this install uses."""

from __future__ import annotations

import os
from typing import Any

import torch
from rich.console import Console

from .. import __version__
from .options import JsonOpt
from .output import emit


def command(json: JsonOpt = False) -> None:
    """Show kvtool's version, supported format versions, codecs and backends."""
    emit(collect(), json, _render)


def collect() -> dict[str, Any]:
    from ..codecs import codec_names, get_codec
    from ..format import SUPPORTED_VERSIONS
    from ..format.layout import VERSION_MAJOR, VERSION_MINOR

    codecs = [{"name": n, "id": get_codec(n).codec_id, "lossless": get_codec(n).lossless,
               "params_version": get_codec(n).params_version} for n in codec_names()]
    backends: dict[str, str] = {}
    try:
        from ..codecs.cachegen import native_available
        from ..codecs.cachegen.native import default_threads

        backends["cachegen"] = (f"native C coder, {default_threads()} threads" if native_available()
                                else "pure-Python reference (native coder not built)")
    except ImportError:
        backends["cachegen"] = "not available"
    from .. import cuda
    from ..engine.default_model import default_model_installed

    backends["paged copy"] = "torch indexing (CPU)" if not cuda.available() else "fused CUDA kernel"
    backends["cuda"] = cuda.backend_status()
    from ..devices import describe, resolve_device

    backends["engine"] = f"--device auto runs the model on {describe(resolve_device('auto'))}"
    model_cache = os.environ.get("KVTOOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvtool")
    return {"kvtool": __version__, "torch": torch.__version__, "writes_format": f"{VERSION_MAJOR}.{VERSION_MINOR}",
            "reads_formats": list(SUPPORTED_VERSIONS), "codecs": codecs, "backends": backends,
            "threads": torch.get_num_threads(),
            "default_model_installed": default_model_installed(),
            "model_cache": model_cache}


def _render(console: Console, r: dict[str, Any]) -> None:
    console.print(f"kvtool {r['kvtool']} (torch {r['torch']}, {r['threads']} threads); writes format "
                  f"{r['writes_format']}, reads {', '.join(r['reads_formats'])}")
    console.print("codecs     " + ", ".join(f"{c['name']} ({c['id']}, {'lossless' if c['lossless'] else 'lossy'})"
                                         for c in r["codecs"]))
    for name, what in r["backends"].items():
        console.print(f"{name:<11}{what}")
    console.print(f"model      default model {'installed' if r['default_model_installed'] else 'NOT installed'}"
                  f"; cache {r['model_cache']}")
