"""The kvtool container (format-spec/container.md): writer, reader, manifest."""

from ..identity import ModelIdentity, model_fingerprint
from .reader import SUPPORTED_VERSIONS, ContainerReader, open_container
from .writer import ContainerWriter, WriterState

__all__ = ["ContainerReader", "ContainerWriter", "ModelIdentity", "SUPPORTED_VERSIONS",
           "WriterState", "model_fingerprint", "open_container"]
