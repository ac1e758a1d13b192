"""The kvtool container (format-spec/container.md): writer, reader, manifest."""

from ..identity import ModelIdentity, model_fingerprint
from .reader import SUPPORTED_VERSIONS, ContainerReader, open_container
from .sinks import FileSink, MemorySink, Sink
from .writer import ContainerWriter, WriterState

__all__ = ["ContainerReader", "ContainerWriter", "FileSink", "MemorySink", "ModelIdentity",
           "SUPPORTED_VERSIONS", "Sink", "WriterState", "model_fingerprint", "open_container"]
