"""OpenAI's error shape: `APIError`, what every refusal of the server raises (protocol.py and
tools.py raise it; api.py answers it).

Invariant: an `APIError`'s message is valid text (a lone surrogate in it is escaped), so its body
encodes."""
from __future__ import annotations

JSON = dict[str, object]


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = code

    def body(self) -> JSON:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
