"""Request and response shapes shared across areas of the API (and by plugins' routes)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PlainSerializer, field_validator, model_validator

from certlm.foundation.certs import api_timestamp

# A date-time field of a response: written as ``certs.api_timestamp`` writes every time the API answers.
Timestamp = Annotated[datetime, PlainSerializer(api_timestamp, return_type=str)]


class OperationResult(BaseModel):
    """The spec's operation result envelope."""

    success: bool
    execution: str
    error: str = ""
    result: dict[str, Any] | list[Any] | None = None


def refuse_null(value: Any) -> Any:
    """A before-validator (``field_validator(..., mode="before")``) for fields that may be left out but are never
    null."""
    if value is None:
        raise ValueError("must not be null; omit the field instead")
    return value


class StrictBody(BaseModel):
    """A request body: no unknown fields, no type coercion, and null is never a value (omit the field)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    not_null = field_validator("*", mode="before")(refuse_null)


class PartialUpdate(BaseModel):
    """A request body whose fields are all optional but of which at least one must be given (spec text)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def at_least_one_field(self) -> PartialUpdate:
        if not self.model_fields_set:
            raise ValueError(f"At least one of {', '.join(type(self).model_fields)} is required")
        return self


class DownloadQuery(BaseModel):
    """The encoding of a certificate or CRL download."""

    format: Literal["pem", "der"] = "pem"


class ErrorBody(BaseModel):
    error: str


def operation_result(execution: str, result: dict[str, Any] | list[Any] | None = None) -> dict[str, Any]:
    return OperationResult(success=True, execution=execution, result=result).model_dump()


def ascii_integer(text: str, max_digits: int) -> int | None:
    """``text`` as a whole number when it is 1 to ``max_digits`` ASCII digits, else None. ``str.isdigit`` is not
    enough: it accepts other scripts' digits (Arabic-Indic three is an id 3) and superscripts ``int`` refuses."""
    if not 1 <= len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def parse_id(value: str, name: str) -> int:
    """A positive integer path parameter; 400 naming the parameter otherwise."""
    from certlm.foundation.errors import APIError

    number = ascii_integer(value, 18)
    if number is None or number < 1:
        raise APIError(f"{name} must be a positive integer, got {value[:40]!r}")
    return number
