"""OpenAI's error shape {"error": {"message", "type", "param", "code"}} for what the server refuses:
its own APIErrors, the engine's ValueErrors (which name the bad SamplingParams field), and
pydantic's validation errors of request bodies. Every 400 carries a code."""
from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from moelora.engine import PromptError
from moelora.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, problems: list[str] | None = None):
        super().__init__(message)
        self.status = status
        if code is None and status == 400:  # OpenAI's code for a value out of its range or rules
            code = "invalid_value"
        self.info = ErrorInfo(message=message, type=type, param=param, code=code, problems=problems)


def error_response(status: int, info: ErrorInfo) -> JSONResponse:
    """OpenAI's shape: param and code always there (null when they do not apply)."""
    body = ErrorResponse(error=info).model_dump()
    if info.problems is None:
        del body["error"]["problems"]
    return JSONResponse(body, status_code=status)


def not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def bad_value(e: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """SamplingParams and the engine name the bad field as SamplingParams.<field>, and raise PromptError
    for the prompt ("prompt" here); `aliases` maps such a field to the request's name for it."""
    m = re.search(r"SamplingParams\.(\w+)", str(e))
    param = "prompt" if isinstance(e, PromptError) else m and m.group(1)
    code = "context_length_exceeded" if "the context holds" in str(e) else None
    return APIError(400, str(e), param=(aliases or {}).get(param, param), code=code)


# pydantic's error types -> OpenAI's codes; the rest are values of the wrong type
_VALIDATION_CODES = {"json_invalid": "invalid_json", "missing": "missing_required_parameter",
                     "invalid_unicode": "invalid_value", "not_finite": "invalid_value", "too_short": "invalid_value",
                     "value_error": "invalid_value", "extra_forbidden": "unknown_parameter",
                     "unsupported_field": "unsupported_parameter", "too_many_values": "invalid_value",
                     "metadata_limits": "invalid_value", "string_too_short": "invalid_value"}


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json, application/*+json)."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _whole_body(err: dict) -> str:
    """How a validation error of the whole body (loc ("body",)) is prefixed: not at all when its
    message names its field (a check that gives the field in its ctx), else "body"."""
    return "" if "param" in err.get("ctx", {}) else "body"


def validation_error(e: RequestValidationError, content_type: str | None = None) -> JSONResponse:
    """A 400 naming the field of the first error (unknown fields and refused ones included); content_type: the
    request's header (a body FastAPI did not read as JSON, for want of it, is not an object)."""
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = first["loc"]  # ("body", field, ...); ("body", position) for malformed JSON
    param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" and first.get("type") != "json_invalid" else None
    param = first.get("ctx", {}).get("param", param)  # a check of the whole body that names its field
    # FastAPI left the body unread as JSON (bytes: not an object), for want of the header
    if tuple(loc) == ("body",) and first.get("type") in ("model_attributes_type", "dict_type") \
            and not _is_json(content_type):
        message = (f"the request body must be JSON sent with the header Content-Type: application/json (it came with "
                   f"{f'Content-Type: {content_type}' if content_type else 'no Content-Type'})")
    elif first.get("type") == "extra_forbidden":
        where = ".".join(str(x) for x in loc[1:])
        message = f"unknown field `{where}`: not an OpenAI or vLLM request field that moelora serves"
    elif first.get("type") == "json_invalid":
        error = first.get("ctx", {}).get("error", "JSON decode error")
        message = f"the request body is not valid JSON: {error} at character {loc[1] if len(loc) > 1 else 0}"
    else:
        # a check of the whole body that names its field (ctx param) says so in its message: no "body: "
        message = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or _whole_body(err)}: {err['msg']}"
                            .removeprefix(": ") for err in errors)
    return error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param,
                                         code=_VALIDATION_CODES.get(first.get("type"), "invalid_type")))
