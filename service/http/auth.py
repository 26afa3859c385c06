"""Optional API keys: `Authorization: Bearer <key>` on every request under /v1/ and /v2/ and on the tokenizer routes.

The keys are the union of `api_keys` (`TSERVE_API_KEYS`) and the lines of `api_keys_file` (`TSERVE_API_KEYS_FILE`);
no key at all = no authentication (the default); a bad configuration fails at app creation (`ApiKeyConfigError`).
Only the Bearer scheme is accepted (its name case-insensitive, RFC 7235; the key case-sensitive). A rejected request
gets 401 with `WWW-Authenticate: Bearer` in the error shape the OpenAI SDK reads; a rejected WebSocket is closed
(1008). A pure ASGI middleware inside the request middleware (`service.http.middleware`), so that a rejected request
still gets its request id and is logged and counted there like any other.

Invariant: no key leaks. The comparison takes the same time whichever key matches, or none (SHA-256 digests compared
with `hmac.compare_digest` against every configured key, no early return); the keys themselves are not kept, and are
never logged, counted or echoed.

Design notes: docs/architecture.md, service/http/auth.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from service.settings import Settings

log = logging.getLogger(__name__)

# A key shorter than this is refused at app creation: too few characters to withstand guessing.
MIN_KEY_CHARS = 16
# A key's characters: visible ASCII, from "!" to "~" (anything else could not travel in a header as it is).
VISIBLE_ASCII = ("!", "~")
# The paths that need a key, with everything under them: the inference and model-listing APIs, the tokenizer routes.
PROTECTED_PREFIXES = ("/v1", "/v2", "/tokenize", "/detokenize", "/tokenizer_info")
# A rejected HTTP request: 401 with this challenge; a rejected WebSocket: closed with "policy violation" (RFC 6455).
UNAUTHORIZED_STATUS, WWW_AUTHENTICATE = 401, b"Bearer"
POLICY_VIOLATION = 1008


class ApiKeyConfigError(ValueError):
    """The API key settings are unusable: raised at app creation."""


def _check_key(key: str, where: str) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ApiKeyConfigError(f"{where}: a key is {len(key)} characters long; API keys must have at least "
                                f"{MIN_KEY_CHARS} characters")
    if not all(VISIBLE_ASCII[0] <= c <= VISIBLE_ASCII[1] for c in key):
        raise ApiKeyConfigError(f"{where}: a key contains whitespace, control or non-ASCII characters; API keys "
                                f"must be visible ASCII")


def _keys_from_file(path: Path) -> list[str]:
    where = f"TSERVE_API_KEYS_FILE ({path})"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        # not str(error): a UnicodeDecodeError quotes the bytes it failed on, which may be part of a key
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror or type(error).__name__
        raise ApiKeyConfigError(f"{where}: cannot read the API key file: {reason}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if key and not key.startswith("#"):
            _check_key(key, f"{where}, line {number}")
            keys.append(key)
    if not keys:  # set but empty: most likely a mistake, and running without authentication would hide it
        raise ApiKeyConfigError(f"{where}: the file holds no API key (only blank lines or comments); unset "
                                f"TSERVE_API_KEYS_FILE to run without authentication")
    return keys


def load_api_keys(settings: Settings) -> frozenset[str]:
    """The configured keys (the union of the setting and the file); empty = no authentication."""
    keys = []
    for index, key in enumerate(settings.api_keys):
        key = key.strip()
        _check_key(key, f"TSERVE_API_KEYS (item {index})")
        keys.append(key)
    if settings.api_keys_file is not None:
        keys += _keys_from_file(Path(settings.api_keys_file))
    return frozenset(keys)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _route_path(scope) -> str:
    """The path the router matches: without the root path (a proxy prefix) when the server put it in front."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


def is_protected(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PROTECTED_PREFIXES)


class ApiKeys:
    """The configured keys' digests, and the check of a request's Authorization values against them: for HTTP
    requests (`ApiKeyMiddleware`) and gRPC calls (their `authorization` metadata, `service.api.oip.grpc.calls`)."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key.encode("ascii")) for key in sorted(keys))

    def __bool__(self) -> bool:
        """Whether any key is configured (none: no authentication)."""
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def _matches(self, token: bytes) -> bool:
        given = _digest(token)
        matched = False
        for digest in self._digests:  # every key, always: the time does not tell which one matched
            matched |= hmac.compare_digest(given, digest)
        return matched

    def check(self, values: list[bytes]) -> str | None:
        """None when the Authorization values (every one the request sent) let it pass, else what is missing or
        wrong (never the key given)."""
        if not values:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        if len(values) > 1:
            return "more than one Authorization header"
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "unsupported Authorization scheme: use 'Authorization: Bearer <key>'"
        token = token.strip(b" \t")
        if not token:
            return "missing API key after 'Bearer'"
        if not self._matches(token):
            return "invalid API key"
        return None


class ApiKeyMiddleware:
    """With no keys, a pass-through; else requests under /v1/ and /v2/ need `Authorization: Bearer <key>`."""

    def __init__(self, app, keys: Iterable[str]):
        self.app = app
        self.keys = ApiKeys(keys)
        if self.keys:
            log.info("API key authentication on for %s (%d key(s))", ", ".join(PROTECTED_PREFIXES), len(self.keys))

    def check(self, scope) -> str | None:
        """None when the request may pass, else what is missing or wrong (never the key given)."""
        headers = scope.get("headers") or ()
        return self.keys.check([value for name, value in headers if name.lower() == b"authorization"])

    async def __call__(self, scope, receive, send):
        if not self.keys or scope["type"] not in ("http", "websocket") or not is_protected(_route_path(scope)):
            return await self.app(scope, receive, send)
        problem = self.check(scope)
        if problem is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            if (await receive())["type"] == "websocket.connect":  # close the handshake: the server answers 403
                await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": "authentication required"})
            return
        body = json.dumps({"error": {"message": problem, "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": UNAUTHORIZED_STATUS,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", WWW_AUTHENTICATE)]})
        await send({"type": "http.response.body", "body": body})
