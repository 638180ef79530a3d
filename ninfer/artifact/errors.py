"""Errors raised for malformed artifacts, bad payloads and misuse of the artifact API.

Every error carries the object it concerns (None for framing and directory-root problems) and a short stable rule id
(e.g. "magic", "json-schema", "alignment"), so callers and tests can tell failures apart without parsing messages.
"""

from __future__ import annotations

from typing import Self


class ArtifactError(Exception):
    """Base of every error the artifact package raises on bad input."""

    def __init__(self, rule: str, detail: str, object_name: str | None = None) -> None:
        super().__init__(rule, detail, object_name)
        self.rule = rule
        self.detail = detail
        self.object_name = object_name

    def __str__(self) -> str:
        where = "artifact" if self.object_name is None else f"object {self.object_name!r}"
        return f"{where}: {self.detail} (rule {self.rule})"

    def for_object(self, object_name: str) -> Self:
        """The same error, attributed to `object_name` (codec errors are raised before the name is known)."""
        return type(self)(self.rule, self.detail, object_name)


class ArtifactFormatError(ArtifactError):
    """The framing, the JSON directory or a registry identity (format, layout, encoding) is invalid."""


class ArtifactGeometryError(ArtifactError):
    """An object's shape, size or placement in the file is invalid."""


class QuantizationError(ArtifactError):
    """Values that cannot be quantized, or quantized payload contents that cannot be dequantized."""


class ArtifactUsageError(ArtifactError):
    """The API was called with a payload, dtype, row range or object kind that does not fit."""


class MissingObjectError(ArtifactError, KeyError):
    """No object of that name in the artifact (also a KeyError, like a failed mapping lookup)."""

    def __str__(self) -> str:  # KeyError's own __str__ would print the args tuple
        return ArtifactError.__str__(self)
