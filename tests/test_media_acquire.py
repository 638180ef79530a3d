"""Media acquisition (ninfer.media.acquire): data: URLs, HTTP(S) fetching against a real local server, limits,
redirects, network policy and error mapping."""

from __future__ import annotations

import base64
import hashlib
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from ninfer.media import acquire as acq
from ninfer.media.acquire import (
    AcquireLimits,
    InvalidMediaUrl,
    MediaAcquireError,
    MediaBudgetExceeded,
    MediaFetchFailed,
    MediaFetchTimeout,
    MediaUrlForbidden,
    acquire,
    forbidden_reason,
    parse_media_source,
)
from ninfer.media.image import MediaError

LOCAL = AcquireLimits(allow_private_networks=True, connect_timeout_s=2.0, total_timeout_s=5.0)


def body_of(n: int) -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(n))


# ------------------------------------------------------------------------------------------------- local server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str, status: int = 302) -> None:
        self._send(status, b"moved", {"Location": location})

    def do_GET(self) -> None:  # noqa: C901 - a small router
        Handler.seen.append({"path": self.path, "host": self.headers.get("Host", ""),
                             "accept-encoding": self.headers.get("Accept-Encoding", "")})
        parts = [p for p in urllib.parse.urlsplit(self.path).path.split("/") if p]
        route, args = (parts[0], parts[1:]) if parts else ("", [])
        try:
            if route == "body":
                self._send(200, body_of(int(args[0])), {"Content-Type": "image/PNG; charset=binary"})
            elif route == "notype":
                self._send(200, b"abc")
            elif route == "chain":
                k = int(args[0])
                self._redirect(f"/chain/{k - 1}" if k > 1 else "/body/100", status=(301, 302, 303, 307, 308)[k % 5])
            elif route == "relative":  # a path-relative Location
                self._redirect("../body/33")
            elif route == "loop":
                self._redirect("/loop")
            elif route == "redirect":  # /redirect?to=<url>[&delay=<seconds>]
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                time.sleep(float(query.get("delay", ["0"])[0]))
                self._redirect(query["to"][0])
            elif route == "nolocation":
                self._send(302, b"")
            elif route == "status":
                self._send(int(args[0]), b"nope")
            elif route == "chunked":  # /chunked/<count>/<size>
                count, size = int(args[0]), int(args[1])
                self.send_response(200)
                self.send_header("Content-Type", "video/mp4")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                data = body_of(count * size)
                for i in range(count):
                    piece = data[i * size:(i + 1) * size]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            elif route == "unsized":  # no Content-Length, body ends at close
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body_of(int(args[0])))
                self.close_connection = True
            elif route == "short":  # Content-Length larger than what is sent
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(b"x" * 10)
                self.close_connection = True
            elif route == "slowheaders":
                time.sleep(float(args[0]))
                self._send(200, b"late")
            elif route == "drip":  # Content-Length 200, one byte every 20 ms
                self.send_response(200)
                self.send_header("Content-Length", "200")
                self.end_headers()
                for _ in range(200):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.02)
            elif route == "dripheaders":  # a header line trickling in byte by byte, for ~4 s
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for _ in range(200):
                    self.wfile.write(b"X")
                    self.wfile.flush()
                    time.sleep(0.02)
                self.wfile.write(b": y\r\nContent-Length: 0\r\n\r\n")
                self.close_connection = True
            elif route == "dripunsized":  # no length: a cut at the deadline must not look like a complete body
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(200):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.02)
                self.close_connection = True
            else:
                self._send(404, b"no route")
        except (BrokenPipeError, ConnectionResetError):
            pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def expect(exc_type: type[MediaAcquireError], status: int, code: str, fn, *a, **kw) -> MediaAcquireError:  # type: ignore[no-untyped-def]
    with pytest.raises(exc_type) as info:
        fn(*a, **kw)
    err = info.value
    assert (err.status, err.code) == (status, code)
    assert isinstance(err, MediaError) and err.message == str(err) and err.message
    return err


# ------------------------------------------------------------------------------------------------- data: URLs


def test_data_url_base64() -> None:
    payload = body_of(1000)
    got = acquire("data:image/png;base64," + base64.b64encode(payload).decode())
    assert got.data == payload and got.media_type == "image/png" and got.source == "data"
    assert got.final_url is None and got.sha256 == hashlib.sha256(payload).hexdigest() and got.size == 1000
    assert got.elapsed_s >= 0


@pytest.mark.parametrize("text", [
    base64.b64encode(b"hello!?").decode().rstrip("="),  # missing padding
    "\n".join(base64.b64encode(b"hello!?").decode()[i:i + 4] for i in range(0, 12, 4)),  # line-wrapped
    urllib.parse.quote(base64.b64encode(b"hello!?").decode(), safe=""),  # percent-encoded '=' (and '+', '/')
])
def test_data_url_base64_tolerated_forms(text: str) -> None:
    assert acquire(f"data:IMAGE/Jpeg;BASE64,{text}").data == b"hello!?"
    assert parse_media_source(f"data:image/jpeg;base64,{text}").media_type == "image/jpeg"


def test_data_url_base64_plus_slash_percent_encoded() -> None:
    raw = bytes([0xFB, 0xEF, 0xFF])  # "++//"
    assert base64.b64encode(raw) == b"++//"
    assert acquire("data:image/png;base64,%2B%2B%2F%2F").data == raw


def test_data_url_percent_encoded_and_params() -> None:
    src = parse_media_source("data:text/plain;charset=utf-8,hello%20w%C3%B6rld%00")
    assert src.kind == "data" and src.data == "hello wörld\x00".encode() and src.media_type == "text/plain"
    assert src.media_type_params == "charset=utf-8"
    default = parse_media_source("data:,A%20b")
    assert default.data == b"A b" and default.media_type == "text/plain"
    assert default.media_type_params == "charset=US-ASCII"
    assert acquire("data:image/svg+xml;utf8=1,<svg/>").data == b"<svg/>"


@pytest.mark.parametrize("url", [
    "data:image/png;base64",  # missing comma
    "data:image/png",
    "data:image/png;base64,@@@@",  # not base64
    "data:image/png;base64,aGVsbG8=x",  # data after padding
    "data:image/png;base64,aGVsb",  # impossible length (4k+1)
    "data:image/png;base64,aGVs-G8_",  # url-safe alphabet
    "data:not a type;base64,aGVsbG8=",  # bad media type
    "data:image/png;noequals;base64,aGVsbG8=",  # bad parameter
])
def test_data_url_malformed(url: str) -> None:
    err = expect(InvalidMediaUrl, 400, "invalid_media_url", acquire, url)
    assert "data URL" in err.message


def test_data_url_budget() -> None:
    payload = base64.b64encode(body_of(1001)).decode()
    limits = AcquireLimits(max_bytes=1000)
    expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, f"data:image/png;base64,{payload}", limits)
    expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, "data:text/plain," + "a" * 1001, limits)
    expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, "data:text/plain," + "%41" * 1001, limits)
    assert acquire("data:text/plain," + "%41" * 1000, limits).data == b"A" * 1000
    ok = base64.b64encode(body_of(1000)).decode()
    assert acquire(f"data:image/png;base64,{ok}", limits).size == 1000


# ------------------------------------------------------------------------------------------------- URL parsing


@pytest.mark.parametrize("url", [
    "file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/", "javascript:alert(1)",
    "example.com/a.png", "//example.com/a.png", "", "c:\\images\\a.png", "ws://example.com/x",
])
def test_unsupported_schemes(url: str) -> None:
    expect(InvalidMediaUrl, 400, "invalid_media_url", acquire, url)


@pytest.mark.parametrize("url", [
    "http://", "https:///path", "http://user:pw@example.com/a.png", "http://example.com:99999/",
    "http://example.com:abc/", "http://exa mple.com/", "http://example.com/a b.png", "http://example.com/\n",
    "http://[::1/", "http://bad_host!/", "http://example.com:0/",
])
def test_malformed_http_urls(url: str) -> None:
    expect(InvalidMediaUrl, 400, "invalid_media_url", parse_media_source, url)


def test_http_url_parsing() -> None:
    src = parse_media_source("HTTPS://Example.COM/a/b.png?x=1&y=%20#frag")
    assert (src.kind, src.scheme, src.host, src.port, src.target) == ("http", "https", "example.com", 443,
                                                                      "/a/b.png?x=1&y=%20")
    assert src.host_header == "example.com" and src.data is None
    v6 = parse_media_source("http://[2001:db8::1]:8080")
    assert (v6.host, v6.port, v6.target, v6.host_header) == ("2001:db8::1", 8080, "/", "[2001:db8::1]:8080")
    idn = parse_media_source("http://bücher.example/ä.png")
    assert idn.host == "xn--bcher-kva.example" and idn.target == "/%C3%A4.png"


# ------------------------------------------------------------------------------------------------- network policy


@pytest.mark.parametrize("addr", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "224.0.0.1",
    "255.255.255.255", "100.64.0.1", "240.0.0.1", "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "2002:7f00:1::1", "64:ff9b::a00:1",
    "2001:db8::1", "::127.0.0.1",
])
def test_forbidden_addresses(addr: str) -> None:
    assert forbidden_reason(addr) is not None


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses(addr: str) -> None:
    assert forbidden_reason(addr) is None


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/body/10", "http://localhost:{port}/body/10", "http://[::1]:{port}/body/10",
    "http://2130706433:{port}/body/10", "http://0.0.0.0:{port}/body/10", "http://[::ffff:127.0.0.1]:{port}/body/10",
])
def test_private_networks_refused(server: str, url: str) -> None:
    port = urllib.parse.urlsplit(server).port
    before = len(Handler.seen)
    err = expect(MediaUrlForbidden, 400, "media_url_forbidden", acquire, url.format(port=port),
                 AcquireLimits(total_timeout_s=5.0))
    assert "network" in err.message
    assert len(Handler.seen) == before  # nothing was sent


def test_redirect_to_forbidden_address_is_rechecked(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend 127.0.0.1 is public so the first hop is allowed; the redirect target 127.0.0.2 stays forbidden.
    real = acq.forbidden_reason
    monkeypatch.setattr(acq, "forbidden_reason", lambda a: None if a == "127.0.0.1" else real(a))
    limits = AcquireLimits(total_timeout_s=5.0)
    port = urllib.parse.urlsplit(server).port
    assert acquire(f"{server}/body/5", limits).data == body_of(5)
    to = urllib.parse.quote(f"http://127.0.0.2:{port}/body/5", safe="")
    expect(MediaUrlForbidden, 400, "media_url_forbidden", acquire, f"{server}/redirect?to={to}", limits)


def test_connects_to_the_checked_address_once_with_original_host(server: str, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """DNS rebinding: one lookup per hop; later lookups answering something else are never made."""
    port = urllib.parse.urlsplit(server).port
    real_getaddrinfo = socket.getaddrinfo
    calls: list[str] = []

    def fake_getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "media.test":
            calls.append(host)
            answer = "127.0.0.1" if len(calls) == 1 else "192.0.2.1"  # a rebinding resolver
            return real_getaddrinfo(answer, *args, **kwargs)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    got = acquire(f"http://media.test:{port}/body/64", LOCAL)
    assert got.data == body_of(64) and calls == ["media.test"]
    assert Handler.seen[-1]["host"] == f"media.test:{port}" and Handler.seen[-1]["accept-encoding"] == "identity"


def test_unresolvable_host() -> None:
    # NXDOMAIN is 502; a resolver that cannot answer within the connect timeout is 504 (offline CI machines)
    with pytest.raises((MediaFetchFailed, MediaFetchTimeout)) as info:
        acquire("http://does-not-exist.invalid/x.png", AcquireLimits(connect_timeout_s=1.0, total_timeout_s=2.0))
    assert info.value.status in (502, 504) and "does-not-exist.invalid" in info.value.message


# ------------------------------------------------------------------------------------------------- HTTP fetching


def test_fetch_body_digest_and_type(server: str) -> None:
    got = acquire(f"{server}/body/100000", LOCAL)
    assert got.data == body_of(100000) and got.sha256 == hashlib.sha256(got.data).hexdigest()
    assert got.media_type == "image/png" and got.final_url == f"{server}/body/100000" and got.source == "http"
    assert got.redirects == 0 and 0 <= got.elapsed_s < 5
    assert acquire(f"{server}/notype", LOCAL).media_type is None
    assert acquire(f"{server}/body/0", LOCAL).data == b""


def test_redirect_chain(server: str) -> None:
    got = acquire(f"{server}/chain/5", LOCAL)
    assert got.data == body_of(100) and got.redirects == 5 and got.final_url == f"{server}/body/100"
    rel = acquire(f"{server}/relative/x", LOCAL)
    assert rel.data == body_of(33) and rel.final_url == f"{server}/body/33"


def test_too_many_redirects(server: str) -> None:
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/chain/3",
                 AcquireLimits(allow_private_networks=True, max_redirects=2))
    assert "redirect" in err.message
    assert acquire(f"{server}/chain/2", AcquireLimits(allow_private_networks=True, max_redirects=2)).redirects == 2
    expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/chain/1",
           AcquireLimits(allow_private_networks=True, max_redirects=0))
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/loop", LOCAL)
    assert "more than 5 redirects" in err.message


def test_redirect_to_other_schemes_refused(server: str) -> None:
    for target in ("file:///etc/passwd", "data:text/plain,hi", "ftp://example.com/x"):
        to = urllib.parse.quote(target, safe="")
        expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/redirect?to={to}", LOCAL)
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/nolocation", LOCAL)
    assert "302" in err.message


@pytest.mark.parametrize("status", [404, 500, 403, 204 + 96])
def test_upstream_error_status(server: str, status: int) -> None:
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/status/{status}", LOCAL)
    assert str(status) in err.message


def test_unknown_route_is_404(server: str) -> None:
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/missing.png", LOCAL)
    assert "HTTP 404" in err.message


def test_content_length_over_cap_rejected(server: str) -> None:
    limits = AcquireLimits(allow_private_networks=True, max_bytes=1000)
    err = expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, f"{server}/body/1001", limits)
    assert "Content-Length" in err.message
    assert acquire(f"{server}/body/1000", limits).size == 1000


def test_chunked_body(server: str) -> None:
    got = acquire(f"{server}/chunked/10/1000", LOCAL)
    assert got.data == body_of(10000) and got.media_type == "video/mp4"
    assert got.sha256 == hashlib.sha256(body_of(10000)).hexdigest()
    cap = AcquireLimits(allow_private_networks=True, max_bytes=5000)
    expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, f"{server}/chunked/10/1000", cap)
    exact = AcquireLimits(allow_private_networks=True, max_bytes=10000)
    assert acquire(f"{server}/chunked/10/1000", exact).size == 10000


def test_unsized_body(server: str) -> None:
    assert acquire(f"{server}/unsized/70000", LOCAL).data == body_of(70000)
    cap = AcquireLimits(allow_private_networks=True, max_bytes=69999)
    expect(MediaBudgetExceeded, 400, "media_budget_exceeded", acquire, f"{server}/unsized/70000", cap)


def test_truncated_body(server: str) -> None:
    expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{server}/short", LOCAL)


def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"http://127.0.0.1:{port}/x", LOCAL)


# ------------------------------------------------------------------------------------------------- timeouts


def test_slow_headers_timeout(server: str) -> None:
    limits = AcquireLimits(allow_private_networks=True, total_timeout_s=0.3)
    t0 = time.monotonic()
    err = expect(MediaFetchTimeout, 504, "media_fetch_timeout", acquire, f"{server}/slowheaders/1.0", limits)
    assert time.monotonic() - t0 < 0.9 and "timed out" in err.message


@pytest.mark.parametrize("route", ["drip", "dripunsized", "dripheaders"])
def test_slow_body_total_timeout(server: str, route: str) -> None:
    """A body that keeps trickling in (each read well under any per-read timeout) still ends at the total."""
    limits = AcquireLimits(allow_private_networks=True, total_timeout_s=0.4)
    t0 = time.monotonic()
    expect(MediaFetchTimeout, 504, "media_fetch_timeout", acquire, f"{server}/{route}", limits)
    assert time.monotonic() - t0 < 1.0


def test_total_timeout_spans_redirects(server: str) -> None:
    """Each hop alone fits in the total timeout; the two together do not."""
    url = f"{server}/redirect?delay=0.25&to=" + urllib.parse.quote("/slowheaders/0.25", safe="")
    assert acquire(url, AcquireLimits(allow_private_networks=True, total_timeout_s=2.0)).data == b"late"
    t0 = time.monotonic()
    expect(MediaFetchTimeout, 504, "media_fetch_timeout", acquire, url,
           AcquireLimits(allow_private_networks=True, total_timeout_s=0.4))
    assert time.monotonic() - t0 < 0.9


def test_caller_deadline(server: str) -> None:
    t0 = time.monotonic()
    expect(MediaFetchTimeout, 504, "media_fetch_timeout", acquire, f"{server}/slowheaders/1.0", LOCAL,
           deadline=time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 0.8


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """Accepts TCP connections and never says anything (a stalled TLS handshake)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    try:
        yield lst.getsockname()[1]
    finally:
        lst.close()


def test_connect_timeout_covers_tls_handshake(silent_listener: int) -> None:
    limits = AcquireLimits(allow_private_networks=True, connect_timeout_s=0.2, total_timeout_s=5.0)
    t0 = time.monotonic()
    expect(MediaFetchTimeout, 504, "media_fetch_timeout", acquire, f"https://127.0.0.1:{silent_listener}/x", limits)
    assert time.monotonic() - t0 < 1.0


# ------------------------------------------------------------------------------------------------- https


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, list[str]]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    names: list[str] = []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.sni_callback = lambda _sock, name, _ctx: names.append(name) and None  # type: ignore[func-returns-value]
    srv = Server(("127.0.0.1", 0), Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{srv.server_address[1]}", cert, names
    finally:
        srv.shutdown()
        srv.server_close()


def test_https_sni_and_verification(tls_server: tuple[str, Path, list[str]]) -> None:
    base, cert, names = tls_server
    client = ssl.create_default_context(cafile=str(cert))
    got = acquire(f"{base}/chain/2", LOCAL, ssl_context=client)
    assert got.data == body_of(100) and got.final_url == f"{base}/body/100" and got.redirects == 2
    assert names and set(names) == {"localhost"}
    assert Handler.seen[-1]["host"] == f"localhost:{urllib.parse.urlsplit(base).port}"
    # the certificate names localhost only: the same server by IP fails hostname verification
    port = urllib.parse.urlsplit(base).port
    err = expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"https://127.0.0.1:{port}/body/1", LOCAL,
                 ssl_context=client)
    assert "certificate" in err.message
    # an untrusted self-signed certificate fails with the default context
    expect(MediaFetchFailed, 502, "media_fetch_failed", acquire, f"{base}/body/1", LOCAL)


# ------------------------------------------------------------------------------------------------- misc


def test_error_mapping_to_api_error() -> None:
    from ninfer.server.context import ApiError

    cases = [(InvalidMediaUrl("m"), 400, "invalid_request_error"), (MediaUrlForbidden("m"), 400,
             "invalid_request_error"), (MediaBudgetExceeded("m"), 400, "invalid_request_error"),
             (MediaFetchFailed("m"), 502, "server_error"), (MediaFetchTimeout("m"), 504, "server_error")]
    for err, status, type_ in cases:
        api = err.to_api_error("messages[0].content[1]")
        assert isinstance(api, ApiError) and (api.status, api.code, api.type, api.message, api.param) == (
            status, err.code, type_, "m", "messages[0].content[1]")
    assert [c[0].code for c in cases] == ["invalid_media_url", "media_url_forbidden", "media_budget_exceeded",
                                          "media_fetch_failed", "media_fetch_timeout"]


def test_limits_validation() -> None:
    d = AcquireLimits()
    assert (d.max_bytes, d.max_redirects, d.allow_private_networks) == (256 * 1024 * 1024, 5, False)
    for bad in ({"max_bytes": 0}, {"max_redirects": -1}, {"connect_timeout_s": 0}, {"total_timeout_s": -1.0}):
        with pytest.raises(ValueError):
            AcquireLimits(**bad)  # type: ignore[arg-type]


def test_concurrent_fetches(server: str) -> None:
    results: dict[int, str] = {}

    def work(i: int) -> None:
        results[i] = acquire(f"{server}/body/{1000 + i}", LOCAL).sha256

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == {i: hashlib.sha256(body_of(1000 + i)).hexdigest() for i in range(8)}
