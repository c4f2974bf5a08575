"""The error of a bad input value that names its field.

`InvalidFieldError` is a ValueError whose `field` attribute is the name of the field the value
was given for (a SamplingParams field, or the engine's `prompt_token_ids`, `priority`, ...), so
that a caller that must say which field was wrong (the server: OpenAI's `param`) reads it there
instead of parsing the message. `InvalidFieldTypeError`, a value of the wrong type, is also a
TypeError. The message (`str(e)`) still starts with the field's name, for people.
"""
from __future__ import annotations


class InvalidFieldError(ValueError):
    """A value of `field` that is refused; `str(e)` is `message`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickles with its field
        return type(self), (self.field, str(self))


class InvalidFieldTypeError(InvalidFieldError, TypeError):
    """A value of `field` of the wrong type (a TypeError as well as an InvalidFieldError)."""
