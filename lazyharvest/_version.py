"""The installed version, read once from the package metadata."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("lazyharvest")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
