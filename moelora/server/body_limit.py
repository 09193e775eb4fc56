"""A cap on the bytes of a request's body, before any of the app reads it: FastAPI reads a JSON body whole into
memory before it validates a field, so without one a single client's multi-gigabyte POST could take the memory
every request's server shares. Over the cap the request gets a 413 in OpenAI's error shape; a declared
Content-Length over it is refused before the body is read at all, a chunked body once its bytes pass it.
Starlette's own RequestBodyLimitMiddleware is not used: it came in Starlette 1.10 (the project takes FastAPI from
0.110 on) and answers in plain text, not in the API's error shape."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from moelora.server.errors import error_response
from moelora.server.protocol import ErrorInfo

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    """Raised into the app by the body's reader once the bytes pass the cap (the app stops reading)."""


class BodyLimit:
    """ASGI middleware: HTTP requests whose body passes max_bytes are answered 413, whatever the route."""

    def __init__(self, app: Callable[[Message, Receive, Send], Awaitable[None]], max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, f" ({int(declared)} bytes)")
        received, too_large, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large:  # whatever the app made of the reader's exception (FastAPI: a 400), the answer is the 413
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if started:  # a response already under way cannot become the 413: it ends cut short, as an error
                raise
        if too_large and not started:
            await self._refuse(scope, receive, send, "")

    async def _refuse(self, scope: Message, receive: Receive, send: Send, declared: str) -> None:
        """The 413. A client that waits for "100 Continue" before it sends its body never sends it: the connection
        closes, else the server would read its next request as this one's body."""
        info = ErrorInfo(message=f"the request's body{declared} is larger than the server takes ({self.max_bytes} "
                                 "bytes: --max-request-mb)", type="invalid_request_error", code="request_too_large")
        response = error_response(413, info)
        if dict(scope["headers"]).get(b"expect", b"").lower() == b"100-continue":
            response.headers["connection"] = "close"
        await response(scope, receive, send)
