"""The error hierarchy every layer raises. Each message is one line that says what to do."""

from __future__ import annotations


class FerrumError(Exception):
    """Base of every error ferrum_mac raises on purpose."""


class ModelFileError(FerrumError):
    """A model path, file or checkpoint that cannot be used as it is."""


class ModelNotFoundError(ModelFileError):
    """Nothing usable at the path or name given."""


class CorruptModelError(ModelFileError):
    """A model file that is truncated, malformed or has tensors of the wrong shape."""


class UnsupportedModelError(ModelFileError):
    """A well-formed model this version cannot run (architecture, tensor type)."""


class KvCapacityError(FerrumError):
    """A request would grow a sequence past `kv_capacity()`; nothing was changed."""

    def __init__(self, message: str, *, needed: int = 0, capacity: int = 0):
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


class UnsupportedError(FerrumError):
    """The backend does not implement this operation; callers may fall back."""


class CacheStateError(FerrumError):
    """A call that does not match a cache's state (unknown id, wrong position)."""
