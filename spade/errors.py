"""User-facing errors: one line that says what is wrong and how to fix it.

The CLI prints ``SpadeError`` messages without a traceback; everything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class SpadeError(Exception):
    """An error the user can fix (bad config, missing package, corrupt file)."""


class ConfigError(SpadeError):
    """A configuration value is invalid. The message names the field."""


class MissingDependencyError(SpadeError):
    """An optional package is needed for the requested feature."""

    def __init__(self, package: str, feature: str, install: str | None = None):
        hint = install or f"pip install {package}"
        super().__init__(f"{feature} needs the package '{package}', which is not installed: {hint}")
        self.package = package


class ModelError(SpadeError):
    """The model could not be resolved, verified or loaded."""


class TransportError(SpadeError):
    """A transport failed: handshake mismatch, timeout, dead peer."""


class PeerTimeout(TransportError):
    """The peer did not answer in time."""


class PeerGone(TransportError):
    """The peer closed the connection or died."""


class ArgumentError(SpadeError, ValueError):
    """A library call got a bad argument value. The message names the argument,
    the value and the fix."""


class ArgumentTypeError(SpadeError, TypeError):
    """A library call got an argument of the wrong type. The message names the
    argument, what it got and what it takes."""


class EngineClosedError(SpadeError, RuntimeError):
    """The engine was closed; build a new one."""
