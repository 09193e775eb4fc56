"""BodyLimit: a body past the cap is a 413 in OpenAI's error shape, by its declared length before it is read or by
its bytes as they come (chunked); the app's handler never sees it; smaller bodies pass untouched."""
import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from moelora.server.app import MAX_REQUEST_BYTES, _Route
from moelora.server.body_limit import BodyLimit

CAP = 1000


class Body(BaseModel):
    prompt: str


def small_app(seen: list[int]) -> FastAPI:
    """/echo: a JSON body FastAPI reads; /raw: a body the handler reads itself (as the server's routes that take
    none do), both under the server's route class."""
    app = FastAPI()
    app.router.route_class = _Route
    app.add_middleware(BodyLimit, max_bytes=CAP)

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        seen.append(len(body.prompt))
        return {"length": len(body.prompt)}

    @app.post("/raw")
    async def raw(request: Request) -> dict:
        seen.append(len(await request.body()))
        return {}
    return app


def post(app: FastAPI, content, headers: dict | None = None, path: str = "/echo") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, content=content, headers={"content-type": "application/json",
                                                                      **(headers or {})})
    return asyncio.run(go())


def chunks(data: bytes, size: int = 100):
    async def gen():
        for i in range(0, len(data), size):
            yield data[i:i + size]
    return gen()


def body(length: int) -> bytes:
    """A JSON body of exactly `length` bytes."""
    return b'{"prompt": "' + b"x" * (length - 14) + b'"}'


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["param"] is None and f"({CAP} bytes" in err["message"], err


@pytest.mark.parametrize("length", [CAP - 1, CAP])
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_up_to_the_cap_pass(length, chunked):
    seen = []
    data = body(length)
    r = post(small_app(seen), chunks(data) if chunked else data)
    assert r.status_code == 200 and r.json() == {"length": length - 14} and seen == [length - 14]


@pytest.mark.parametrize("path", ["/echo", "/raw"])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_past_the_cap_is_a_413_the_handler_never_sees(chunked, path, caplog):
    """Also where the handler reads the body itself: a 413, not logged as the route's failure."""
    seen = []
    data = body(CAP + 1)
    assert_refused(post(small_app(seen), chunks(data) if chunked else data, path=path))
    assert seen == [] and not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_declared_length_past_the_cap_is_refused_before_the_body_is_read():
    seen, read = [], []

    async def never_read():  # the body's first bytes would be recorded here
        read.append(True)
        yield b"{}"
    r = post(small_app(seen), never_read(), headers={"content-length": str(CAP + 1)})
    assert_refused(r)
    assert "1001 bytes" in r.json()["error"]["message"] and seen == [] and read == []


@pytest.mark.parametrize("expect", [False, True])
def test_the_server_refuses_a_body_past_its_default_cap_from_the_headers(server, expect):
    """Through uvicorn: a request declaring more than MAX_REQUEST_BYTES gets its 413 without sending any of it; a
    client waiting for "100 Continue" (which will never send the body) has the connection closed after it."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"{'Expect: 100-continue' + chr(13) + chr(10) if expect else ''}"
                  f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n".encode())
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            response += data
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), response
        assert b'"request_too_large"' in payload and str(MAX_REQUEST_BYTES).encode() in payload
        assert (b"connection: close" in head.lower()) == expect
        if expect:
            assert s.recv(65536) == b""  # closed: no next request is read as this one's body
