"""The kvtool container (format-spec/container.md): writer, reader, manifest."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..identity import ModelIdentity, model_fingerprint
    from .reader import SUPPORTED_VERSIONS, ContainerReader, open_container
    from .sinks import FileSink, MemorySink, Sink
    from .writer import ContainerWriter, WriterState

# Loaded on first use (PEP 562): `format.layout`'s constants are read without the reader, the
# writer and numpy (a usage error answers as fast as --help).
_WHERE = {"ModelIdentity": "..identity", "model_fingerprint": "..identity", "SUPPORTED_VERSIONS": ".reader",
          "ContainerReader": ".reader", "open_container": ".reader", "FileSink": ".sinks", "MemorySink": ".sinks",
          "Sink": ".sinks", "ContainerWriter": ".writer", "WriterState": ".writer"}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool.format' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = ["ContainerReader", "ContainerWriter", "FileSink", "MemorySink", "ModelIdentity",
           "SUPPORTED_VERSIONS", "Sink", "WriterState", "model_fingerprint", "open_container"]
