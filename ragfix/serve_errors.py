"""The error a ``ragfix serve`` request is refused with, in OpenAI's error format."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses, answered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        """The OpenAI error object."""
        kind = {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


__all__ = ["ApiError"]
