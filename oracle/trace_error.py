"""The error a malformed trace raises: it names the field (and the request)."""
from __future__ import annotations


class TraceError(ValueError):
    """A trace is malformed; the message names the field and (for request fields) the request id."""

    def __init__(self, field_path: str, message: str, request_id: str | None = None):
        self.field = field_path
        self.request_id = request_id
        where = f"{field_path} (request {request_id!r})" if request_id is not None else field_path
        super().__init__(f"{where}: {message}")
