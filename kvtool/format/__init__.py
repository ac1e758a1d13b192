"""The kvtool container (format-spec/container.md): writer, reader, manifest."""

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)

__all__ = ["ContainerReader", "ContainerWriter", "FileSink", "MemorySink", "ModelIdentity",
           "SUPPORTED_VERSIONS", "Sink", "WriterState", "model_fingerprint", "open_container"]
