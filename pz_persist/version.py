"""The library version (the manifest format has its own, FORMAT_VERSION)."""

__version__ = "0.7.0"
