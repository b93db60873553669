"""OpenAI-style error bodies, as vLLM and the OpenAI API send them, for the gateway and the simulator.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``; the type
names follow vLLM's (``BadRequestError``, ``NotFoundError``...).
"""

from __future__ import annotations

from aiohttp import web

__all__ = ["error_body", "openai_error", "response_not_found"]

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          408: "RequestTimeoutError", 413: "RequestTooLargeError",
          415: "UnsupportedMediaTypeError", 429: "RateLimitError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict:
    """The error object; ``type_`` defaults to the status's usual name."""
    return {"error": {"message": message, "type": type_ or _TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def openai_error(status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:
    """An error response with that body and status (and ``headers``, such as Retry-After)."""
    return web.json_response(error_body(status, message, param, type_), status=status, headers=headers)


def response_not_found(response_id: str, param: str | None = None) -> web.Response:
    """vLLM's 404 for a stored Response it does not hold (``responses/serving.py``), which the
    gateway also gives a tenant asking for another's."""
    return openai_error(404, f"Response with id '{response_id[:200]}' not found.", param, type_="NotFoundError")
