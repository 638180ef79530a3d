"""Media byte acquisition: ``data:`` URLs and HTTP(S) URLs (serving.md multimodal sections, issue 7 item 1).

``acquire(url, limits)`` turns a request's media URL into bytes, synchronously (the server calls it from a
worker thread):

* ``data:[<media type>][;base64],<data>`` (RFC 2397): base64 (standard alphabet, whitespace and missing padding
  tolerated, anything else refused) or percent-encoded payloads; the media type is kept.
* ``http://`` / ``https://``: the host is resolved once here, every resolved address is checked against the
  network policy (loopback, private, link-local, multicast, reserved, unspecified, shared, IPv4-mapped / 6to4 /
  Teredo embeddings of those are refused unless ``allow_private_networks``), and the connection goes to the very
  address that was checked - there is no second DNS lookup, so DNS rebinding cannot swap in an internal address.
  The original ``Host`` header is sent; https uses SNI and certificate hostname verification for the URL's host.
  Redirects (301/302/303/307/308) are followed by hand up to ``max_redirects``, each target parsed and checked
  again. ``max_bytes`` is enforced before reading (``Content-Length``) and while streaming (chunked or unknown
  length). The connect timeout bounds DNS + TCP + TLS per hop; the total timeout bounds everything, across
  redirects and the body (a watchdog shuts the socket down at the deadline, so a slow drip cannot outlive it).
* Every other scheme (``file:``, ``ftp:``, ...) is refused.

Errors subclass :class:`ninfer.media.image.MediaError` and carry ``status`` / ``code`` / ``type`` / ``message``
/ ``param`` so the server maps them 1:1 onto an ``ApiError`` (:meth:`MediaAcquireError.to_api_error`):

====================  ======  ===========================================================================
class                 status  code
====================  ======  ===========================================================================
InvalidMediaUrl       400     ``invalid_media_url`` (unsupported scheme, malformed data/HTTP URL)
MediaUrlForbidden     400     ``media_url_forbidden`` (resolves to a refused network)
MediaBudgetExceeded   400     ``media_budget_exceeded`` (source bytes over ``max_bytes``)
MediaFetchFailed      502     ``media_fetch_failed`` (DNS/connect/TLS errors, non-2xx, too many redirects)
MediaFetchTimeout     504     ``media_fetch_timeout`` (connect or total timeout)
====================  ======  ===========================================================================
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Literal

import attrs

from ninfer.media.errors import MediaBudgetExceeded, MediaError

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_REDIRECTS = 5
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_TOTAL_TIMEOUT_S = 60.0
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK = 64 * 1024
_USER_AGENT = "ninfer-media/1"
_MESSAGE_URL_CHARS = 200  # URLs echoed into error messages are shortened to this many characters


# ------------------------------------------------------------------------------------------------- errors


class MediaAcquireError(MediaError):
    """A media URL could not be turned into bytes (status, code, message and param as every MediaError)."""

    status: int = 400
    code: str = "invalid_media_url"


class InvalidMediaUrl(MediaAcquireError):
    status, code = 400, "invalid_media_url"


class MediaUrlForbidden(MediaAcquireError):
    status, code = 400, "media_url_forbidden"


class MediaFetchFailed(MediaAcquireError):
    status, code = 502, "media_fetch_failed"


class MediaFetchTimeout(MediaAcquireError):
    status, code = 504, "media_fetch_timeout"


# ------------------------------------------------------------------------------------------------- values


def _positive(_inst: Any, attribute: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class AcquireLimits:
    """Per-item acquisition limits. ``max_bytes`` caps the source bytes of one item (data or HTTP body)."""

    max_bytes: int = attrs.field(default=DEFAULT_MAX_BYTES, validator=_positive)
    max_redirects: int = attrs.field(default=DEFAULT_MAX_REDIRECTS, validator=attrs.validators.ge(0))
    connect_timeout_s: float = attrs.field(default=DEFAULT_CONNECT_TIMEOUT_S, validator=_positive)
    total_timeout_s: float = attrs.field(default=DEFAULT_TOTAL_TIMEOUT_S, validator=_positive)
    allow_private_networks: bool = False


@attrs.frozen(kw_only=True)
class MediaSource:
    """A parsed media URL. ``kind == "data"``: ``data`` holds the decoded payload and ``media_type`` the declared
    type. ``kind == "http"``: ``scheme`` / ``host`` (lower-case, IDNA-encoded, IPv6 without brackets) / ``port`` /
    ``target`` (the request target: path and query, percent-encoded) describe the request; ``data`` is None."""

    kind: Literal["data", "http"]
    url: str = attrs.field(repr=lambda u: _short(u))
    media_type: str | None = None
    media_type_params: str = ""  # data: URLs, e.g. "charset=utf-8" (without ";base64")
    data: bytes | None = attrs.field(default=None, repr=lambda d: "None" if d is None else f"<{len(d)} bytes>")
    scheme: str | None = None
    host: str | None = None
    port: int | None = None
    target: str | None = None

    @property
    def host_header(self) -> str:
        """The ``Host`` header value: host (bracketed if IPv6), port only when not the scheme's default."""
        assert self.host is not None and self.port is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@attrs.frozen(kw_only=True)
class AcquiredMedia:
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    media_type: str | None  # bare lower-case "type/subtype" (Content-Type or data: type); None if absent
    final_url: str | None  # the URL the bytes came from after redirects; None for data: URLs
    sha256: str  # hex digest of ``data``
    elapsed_s: float
    source: Literal["data", "http"]
    redirects: int = 0

    @property
    def size(self) -> int:
        return len(self.data)


# ------------------------------------------------------------------------------------------------- parsing


def _short(url: str) -> str:
    return url if len(url) <= _MESSAGE_URL_CHARS else url[:_MESSAGE_URL_CHARS] + "..."


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_TYPE_RE = re.compile(rf"^{_TOKEN}/{_TOKEN}$")
_B64_CHARS_RE = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
_CONTROL_RE = re.compile(r"[\x00-\x20\x7f]")


def _data_budget(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise MediaBudgetExceeded(f"media data URL payload is {size} bytes, over the {max_bytes}-byte source limit")


def _parse_data_url(url: str, max_bytes: int | None) -> MediaSource:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidMediaUrl("malformed data URL: missing ',' between the media type and the data")
    params = [p.strip() for p in head.split(";")]
    is_base64 = len(params) > 1 and params[-1].lower() == "base64"
    if is_base64:
        params = params[:-1]
    mtype = urllib.parse.unquote(params[0]).strip().lower() if params else ""
    extra = [p for p in params[1:] if p]
    if mtype and not _MEDIA_TYPE_RE.match(mtype):
        raise InvalidMediaUrl(f"malformed data URL: invalid media type {_short(params[0])!r}")
    for p in extra:
        if "=" not in p or not p.partition("=")[0].strip():
            raise InvalidMediaUrl(f"malformed data URL: invalid media type parameter {_short(p)!r}")
    if not mtype:  # RFC 2397 default
        mtype, extra = "text/plain", extra or ["charset=US-ASCII"]
    if is_base64:
        # Percent-escapes are legal in a data URL, whitespace is commonly wrapped in; both are transparent.
        text = "".join(urllib.parse.unquote(payload).split()) if "%" in payload else "".join(payload.split())
        if not _B64_CHARS_RE.match(text):
            raise InvalidMediaUrl("malformed data URL: the payload is not valid base64")
        stripped = len(text.rstrip("="))
        _data_budget(stripped * 3 // 4, max_bytes)  # before decoding: no allocation past the cap
        if stripped % 4 == 1:
            raise InvalidMediaUrl("malformed data URL: the base64 payload has an invalid length")
        text = text.rstrip("=") + "=" * (-stripped % 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidMediaUrl("malformed data URL: the payload is not valid base64") from None
    else:
        _data_budget(len(payload) // 3 if "%" in payload else len(payload.encode("utf-8")), max_bytes)
        data = urllib.parse.unquote_to_bytes(payload)
        _data_budget(len(data), max_bytes)
    return MediaSource(kind="data", url=url, media_type=mtype, media_type_params=";".join(extra), data=data)


def _encode_target(path: str, query: str) -> str:
    """The request target: non-ASCII and spaces percent-encoded (UTF-8), everything else kept as sent."""
    target = (path or "/") + (f"?{query}" if query else "")
    return urllib.parse.quote(target, safe="".join(chr(c) for c in range(0x21, 0x7F)))


def _parse_http_url(url: str) -> MediaSource:
    if _CONTROL_RE.search(url):
        raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: control characters or spaces")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        raise InvalidMediaUrl("media URLs with embedded credentials (user:password@) are not supported")
    host = parts.hostname  # lower-cased, IPv6 brackets removed
    if not host:
        raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: missing host")
    if "%" in host:  # IPv6 zone ids / percent-escaped hosts
        raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: unsupported host {host!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if parts.netloc.rpartition("@")[2].startswith("["):
            raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: invalid IPv6 literal") from None
        try:
            host = host.encode("idna").decode("ascii").lower() if not host.isascii() else host
        except UnicodeError:
            raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: invalid host name") from None
        labels = host.rstrip(".").split(".")
        if not all(labels) or not all(re.fullmatch(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?", lb) for lb in labels):
            raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: invalid host name {host!r}")
    if port is None:
        port = 443 if scheme == "https" else 80
    elif port == 0:
        raise InvalidMediaUrl(f"malformed media URL {_short(url)!r}: port 0")
    return MediaSource(kind="http", url=url, scheme=scheme, host=host, port=port,
                       target=_encode_target(parts.path, parts.query))


def parse_media_source(url: str, *, max_bytes: int | None = None) -> MediaSource:
    """Parse a media URL. data: payloads are decoded here (``max_bytes``, when given, caps the decoded size:
    400 media_budget_exceeded). Any scheme other than data/http/https is 400 invalid_media_url."""
    if not isinstance(url, str) or not url:
        raise InvalidMediaUrl("the media URL must be a non-empty string")
    scheme, colon, _ = url.partition(":")
    if not colon or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise InvalidMediaUrl(f"unsupported media URL {_short(url)!r}: expected an http(s) or data: URL")
    scheme = scheme.lower()
    if scheme == "data":
        return _parse_data_url(url, max_bytes)
    if scheme in ("http", "https"):
        return _parse_http_url(url)
    raise InvalidMediaUrl(f"unsupported media URL scheme {scheme!r}: only http, https and data URLs are accepted")


# ------------------------------------------------------------------------------------------------- network policy


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    out = []
    if ip.ipv4_mapped is not None:
        out.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        out.append(ip.sixtofour)
    if ip.teredo is not None:
        out.extend(ip.teredo)
    if ip in _NAT64:  # 64:ff9b::/96 well-known NAT64 prefix
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def forbidden_reason(address: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is refused without ``allow_private_networks`` (None: a public unicast address)."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and (ip.ipv4_mapped is not None or ip in _NAT64):
        inner = ip.ipv4_mapped or ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)  # judged by the IPv4 it reaches
        reason = forbidden_reason(inner)
        return None if reason is None else f"{reason} (embedded IPv4 {inner})"
    checks = (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
              ("multicast", ip.is_multicast), ("private", ip.is_private), ("reserved", ip.is_reserved))
    for name, hit in checks:
        if hit:
            return name
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_site_local:
            return "site-local"
        for inner in _embedded_ipv4(ip):
            reason = forbidden_reason(inner)
            if reason is not None:
                return f"{reason} (embedded IPv4 {inner})"
    if not ip.is_global:
        return "non-global"
    return None


# ------------------------------------------------------------------------------------------------- fetching


class _Deadline:
    """The total-timeout clock plus a watchdog that shuts the live socket down when it expires."""

    def __init__(self, total_s: float, deadline: float | None) -> None:
        end = time.monotonic() + total_s
        self.end = end if deadline is None else min(end, deadline)
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, self.end - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> float:
        left = self.remaining()
        if left <= 0 or self.expired:
            self.expired = True
            raise MediaFetchTimeout(what)
        return left

    def watch(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            fire = self.expired
        if fire and sock is not None:
            self._shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def _resolve(src: MediaSource, limits: AcquireLimits, clock: _Deadline) -> list[tuple[Any, ...]]:
    """getaddrinfo under the connect timeout (in a helper thread: the resolver has no timeout of its own)."""
    host, port = src.host, src.port
    assert host is not None and port is not None
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    if literal:
        run()
    else:
        worker = threading.Thread(target=run, name="ninfer-media-dns", daemon=True)
        worker.start()
        worker.join(min(limits.connect_timeout_s, clock.check(f"timed out fetching {_short(src.url)}")))
        if worker.is_alive():
            raise MediaFetchTimeout(f"timed out resolving media host {host!r}")
    if "error" in result:
        raise MediaFetchFailed(f"could not resolve media host {host!r}: {result['error']}")
    infos = [i for i in result["infos"] if i[0] in (socket.AF_INET, socket.AF_INET6)]
    if not infos:
        raise MediaFetchFailed(f"could not resolve media host {host!r}: no IPv4/IPv6 address")
    if limits.allow_private_networks:
        return infos
    allowed, refused = [], []
    for info in infos:
        reason = forbidden_reason(info[4][0].split("%")[0])
        (allowed if reason is None else refused).append((info, reason))
    if not allowed:
        addr, reason = refused[0][0][4][0], refused[0][1]
        raise MediaUrlForbidden(f"media URL host {host!r} resolves to {addr} ({reason} network); fetching from "
                                f"private, loopback and other non-public networks is disabled")
    return [info for info, _ in allowed]


def _connect(src: MediaSource, infos: list[tuple[Any, ...]], limits: AcquireLimits, clock: _Deadline,
             ssl_context: ssl.SSLContext | None) -> socket.socket:
    """TCP (+TLS) to the first reachable checked address; the connect timeout covers each attempt's TCP+TLS."""
    last: BaseException | None = None
    for family, socktype, proto, _canon, sockaddr in infos:
        left = clock.check(f"timed out connecting to {_short(src.url)}")
        sock = socket.socket(family, socktype, proto)
        clock.watch(sock)
        try:
            sock.settimeout(min(limits.connect_timeout_s, left))
            sock.connect(sockaddr)
            if src.scheme == "https":
                ctx = ssl_context or ssl.create_default_context()
                sock.settimeout(min(limits.connect_timeout_s, clock.check(f"timed out connecting to "
                                                                          f"{_short(src.url)}")))
                tls = ctx.wrap_socket(sock, server_hostname=src.host)  # SNI + hostname verification
                clock.watch(tls)
                return tls
            return sock
        except MediaError:  # typed media errors (budget ones too) pass through as they are
            sock.close()
            raise
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise MediaFetchFailed(f"TLS certificate verification failed for {src.host!r}: "
                                   f"{exc.verify_message or exc}") from None
        except (socket.timeout, TimeoutError) as exc:
            sock.close()
            last = exc
            if clock.expired or clock.remaining() <= 0:
                raise MediaFetchTimeout(f"timed out connecting to {_short(src.url)}") from None
        except OSError as exc:
            sock.close()
            if clock.expired:
                raise MediaFetchTimeout(f"timed out connecting to {_short(src.url)}") from None
            last = exc
    if isinstance(last, (socket.timeout, TimeoutError)):
        raise MediaFetchTimeout(f"timed out connecting to {_short(src.url)} "
                                f"(connect timeout {limits.connect_timeout_s:g} s)")
    raise MediaFetchFailed(f"could not connect to {_short(src.url)}: {last}")


def _bare_media_type(content_type: str | None) -> str | None:
    if not content_type:
        return None
    mtype = content_type.split(";", 1)[0].strip().lower()
    return mtype if _MEDIA_TYPE_RE.match(mtype) else None


def _fetch_once(src: MediaSource, limits: AcquireLimits, clock: _Deadline, ssl_context: ssl.SSLContext | None
                ) -> tuple[int, str | None, bytes | None, str | None]:
    """One GET. Returns (status, Location, body or None for redirects/errors, Content-Type)."""
    infos = _resolve(src, limits, clock)
    sock = _connect(src, infos, limits, clock, ssl_context)
    conn = http.client.HTTPConnection(src.host_header, timeout=None)
    conn.sock = sock  # already connected to the checked address: http.client never resolves the name itself
    timeout_msg = f"timed out fetching media from {_short(src.url)} (total timeout {limits.total_timeout_s:g} s)"
    resp: http.client.HTTPResponse | None = None
    try:
        sock.settimeout(clock.check(timeout_msg))
        conn.putrequest("GET", src.target or "/", skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", src.host_header)
        conn.putheader("Accept-Encoding", "identity")
        conn.putheader("Accept", "image/*, video/*, */*;q=0.8")
        conn.putheader("User-Agent", _USER_AGENT)
        conn.putheader("Connection", "close")
        conn.endheaders()
        sock.settimeout(clock.check(timeout_msg))
        resp = conn.getresponse()
        status = resp.status
        if status in REDIRECT_STATUSES or not 200 <= status < 300:
            return status, resp.getheader("Location"), None, None
        length_header = resp.getheader("Content-Length")
        if length_header is not None and resp.length is not None and resp.length > limits.max_bytes:
            raise MediaBudgetExceeded(f"media at {_short(src.url)} is {resp.length} bytes (Content-Length), over "
                                      f"the {limits.max_bytes}-byte source limit")
        chunks: list[bytes] = []
        total = 0
        while True:
            sock.settimeout(clock.check(timeout_msg))
            chunk = resp.read1(min(_READ_CHUNK, limits.max_bytes + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limits.max_bytes:
                raise MediaBudgetExceeded(f"media at {_short(src.url)} exceeds the {limits.max_bytes}-byte source "
                                          f"limit")
            chunks.append(chunk)
        if clock.expired:  # the watchdog shut the socket down: the EOF above is not the end of the body
            raise MediaFetchTimeout(timeout_msg)
        if resp.length:  # declared length not fully received
            raise MediaFetchFailed(f"media at {_short(src.url)} ended early ({total} bytes received, "
                                   f"{resp.length} more expected)")
        return status, None, b"".join(chunks), resp.getheader("Content-Type")
    except MediaError:
        raise
    except (socket.timeout, TimeoutError):
        raise MediaFetchTimeout(timeout_msg) from None
    except http.client.IncompleteRead as exc:
        if clock.expired:
            raise MediaFetchTimeout(timeout_msg) from None
        raise MediaFetchFailed(f"media at {_short(src.url)} ended early ({len(exc.partial)} bytes read)") from None
    except (http.client.HTTPException, OSError, ValueError) as exc:
        if clock.expired or clock.remaining() <= 0:
            raise MediaFetchTimeout(timeout_msg) from None
        raise MediaFetchFailed(f"fetching media from {_short(src.url)} failed: "
                               f"{type(exc).__name__}: {exc}") from None
    finally:
        clock.watch(None)
        if resp is not None:
            resp.close()  # drops the makefile() reference that would keep the descriptor open
        conn.close()
        try:
            sock.close()
        except OSError:
            pass


def _acquire_http(src: MediaSource, limits: AcquireLimits, started: float, deadline: float | None,
                  ssl_context: ssl.SSLContext | None) -> AcquiredMedia:
    clock = _Deadline(limits.total_timeout_s, deadline)
    try:
        redirects = 0
        while True:
            status, location, body, content_type = _fetch_once(src, limits, clock, ssl_context)
            if body is not None:
                return AcquiredMedia(data=body, media_type=_bare_media_type(content_type), final_url=src.url,
                                     sha256=hashlib.sha256(body).hexdigest(), elapsed_s=time.monotonic() - started,
                                     source="http", redirects=redirects)
            if status not in REDIRECT_STATUSES or not location:
                raise MediaFetchFailed(f"fetching media from {_short(src.url)} failed: upstream returned HTTP "
                                       f"{status} {http.client.responses.get(status, '')}".rstrip())
            if redirects >= limits.max_redirects:
                raise MediaFetchFailed(f"fetching media from {_short(src.url)} failed: more than "
                                       f"{limits.max_redirects} redirects")
            redirects += 1
            target = urllib.parse.urljoin(src.url, location.strip())
            try:
                nxt = parse_media_source(target)
            except InvalidMediaUrl as exc:
                raise MediaFetchFailed(f"media URL {_short(src.url)} redirected to an unusable URL: "
                                       f"{exc.message}") from None
            if nxt.kind != "http":
                raise MediaFetchFailed(f"media URL {_short(src.url)} redirected to a non-HTTP(S) URL")
            src = nxt
    finally:
        clock.cancel()


def acquire(url: str | MediaSource, limits: AcquireLimits | None = None, *,
            deadline: float | None = None, ssl_context: ssl.SSLContext | None = None) -> AcquiredMedia:
    """Fetch or decode one media URL into bytes (blocking). ``deadline`` (a ``time.monotonic()`` value, e.g. the
    request's pending deadline) tightens the total timeout. ``ssl_context`` replaces the default verifying context
    (``ssl.create_default_context()``; a replacement should keep ``check_hostname``), e.g. for a private CA.
    Raises a :class:`MediaAcquireError` subclass."""
    limits = limits or AcquireLimits()
    started = time.monotonic()
    src = url if isinstance(url, MediaSource) else parse_media_source(url, max_bytes=limits.max_bytes)
    if src.kind == "data":
        assert src.data is not None
        _data_budget(len(src.data), limits.max_bytes)
        return AcquiredMedia(data=src.data, media_type=src.media_type, final_url=None,
                             sha256=hashlib.sha256(src.data).hexdigest(), elapsed_s=time.monotonic() - started,
                             source="data")
    return _acquire_http(src, limits, started, deadline, ssl_context)


__all__ = [
    "AcquireLimits",
    "AcquiredMedia",
    "InvalidMediaUrl",
    "MediaAcquireError",
    "MediaBudgetExceeded",
    "MediaFetchFailed",
    "MediaFetchTimeout",
    "MediaSource",
    "MediaUrlForbidden",
    "acquire",
    "forbidden_reason",
    "parse_media_source",
]
