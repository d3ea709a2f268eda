"""Who may talk to the server from a browser: the Host, Origin and Content-Type rules.

A web page the user opens can make the browser send requests to ``127.0.0.1:8080`` in two ways
that need no cooperation from the server:

- a *simple* cross-site request (no CORS preflight): a POST whose body is ``text/plain``, form
  data or untyped. The page cannot read the answer, but the request runs. Every POST body must
  therefore declare a JSON media type (``json_media_type``), which a page can send only after a
  preflight that the server answers only with ``--cors``; and a POST that names a foreign
  ``Origin`` (``origin_allowed``: not this server's own) is refused without ``--cors``, which covers body-less actions
  (``/slots/{id}?action=erase``). FastAPI refuses non-JSON bodies for the same reason
  (CVE-2021-32677); Jupyter checks Origin.
- *DNS rebinding*: the page's own name (``evil.example``) is re-pointed at 127.0.0.1, so its
  requests are same-origin and it can read the answers (``/slots``, ``/events``). The browser
  still sends ``Host: evil.example``, so ``host_allowed`` accepts only names that cannot be
  rebound by someone else: IP literals (rebinding needs a name), ``localhost``, the ``--host``
  name, this machine's hostname and ``--allowed-hosts`` (``*``: any). Jupyter and Ollama refuse
  such a Host with 403 as well; they skip the check when bound to a non-loopback address, we do
  not (a firewalled machine's browser reaches its 0.0.0.0 listener too).
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

# body-less POSTs need no Content-Type; these may carry a body on the routes that take one
JSON_TYPES = ("application/json",)
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-seq")


def local_names(bind_host: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The host names this server answers to: ``localhost``, ``bind_host`` when it is a name,
    this machine's hostname and ``allowed`` (lowercase; ``.domain`` matches its subdomains)."""
    names = {"localhost", socket.gethostname().lower().rstrip(".")}
    if not _is_ip(bind_host):
        names.add(bind_host.lower().rstrip("."))
    return tuple(sorted(names - {""})) + tuple(allowed)


def host_allowed(host_header: str, names: tuple[str, ...]) -> bool:
    """Whether a request's ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names this
    server: any IP address, a name in ``names`` (``*`` any; ``.domain`` the domain and its
    subdomains), or none at all (HTTP/1.0)."""
    host = _hostname(host_header)
    if host is None:
        return False
    return host == "" or _is_ip(host) or _named(host, names)


def origin_allowed(origin: str, host_header: str) -> bool:
    """Whether a browser's ``Origin`` is this server's own (scheme://Host, any scheme): a page
    it served (the dashboard). Every other page, ``null`` (a sandboxed or ``file:`` page)
    included, needs ``--cors``, whatever ``--allowed-hosts`` says (that names this server,
    not the pages that may drive it)."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    netloc = parts.netloc.lower()
    return bool(parts.scheme and netloc) and netloc == host_header.strip().lower()


def json_media_type(content_type: str, extra: tuple[str, ...] = ()) -> bool:
    """Whether ``content_type`` is JSON: ``application/json`` or ``application/*+json`` (RFC
    6839), any parameters (``; charset=utf-8``), any case; or one of ``extra``."""
    mtype = content_type.split(";", 1)[0].strip().lower()
    return mtype in JSON_TYPES or mtype in extra or (
        mtype.startswith("application/") and mtype.endswith("+json"))


def charset(content_type: str) -> str | None:
    """The ``charset`` parameter of ``content_type`` (lowercase, unquoted), or None."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def _hostname(host_header: str) -> str | None:
    """The name or address of a Host header without its port (lowercase, one trailing dot
    dropped); None when malformed."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        if end < 0 or (h[end + 1:] and not h[end + 1:].startswith(":")):
            return None
        return h[1:end]
    if h.count(":") > 1:   # an IPv6 address without brackets
        return h
    return h.split(":", 1)[0].rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _named(host: str, names: tuple[str, ...]) -> bool:
    for name in names:
        if name == "*" or host == name or (name.startswith(".") and (
                host == name[1:] or host.endswith(name))):
            return True
    return False
