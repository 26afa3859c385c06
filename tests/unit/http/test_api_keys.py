"""Optional API keys (service.http.auth): Bearer keys on /v1/ and /v2/, health/metrics/docs open, 401 in the OpenAI
error shape, constant-time comparison against every key, keys never in logs or metrics, bad settings fail at app
creation. Through the in-process ASGI app (lifespan running)."""

from __future__ import annotations

import hmac
import json
import logging

import pytest
from starlette.websockets import WebSocketDisconnect

from service.app import create_app
from service.http import auth
from service.http.auth import ApiKeyConfigError, ApiKeyMiddleware, load_api_keys
from service.observability.logs import JSONFormatter
from service.settings import Settings

pytestmark = pytest.mark.slow

LIST_KEYS = ["list-key-0123456789abcdef", "list-key-fedcba9876543210"]
FILE_KEYS = ["file-key-AAAAAAAAAAAAAAAA", "file-key-BBBBBBBBBBBBBBBB"]
ALL_KEYS = LIST_KEYS + FILE_KEYS
WRONG_KEY = "wrong-key-0000000000000000"
KEY_FILE = f"""# API keys for the tests
{FILE_KEYS[0]}

   # an indented comment, then a key with spaces around it
   {FILE_KEYS[1]}   

"""
GENERATE = {"prompt": "A", "max_new_tokens": 2}
TRANSLATE = {"text": "Ein Hund.", "max_new_tokens": 2, "num_beams": 1}
PROTECTED = [("POST", "/v1/generate", GENERATE), ("POST", "/v1/translate", TRANSLATE), ("GET", "/v1/models", None),
             ("POST", "/tokenize", {"prompt": "To be"}), ("POST", "/detokenize", {"tokens": [84, 111]}),
             ("GET", "/tokenizer_info", None)]
OPEN_PATHS = ["/health/live", "/health/ready", "/metrics", "/openapi.json", "/docs", "/redoc"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def call(client, method, path, payload=None, headers=None):
    return client.request(method, path, json=payload, headers=headers)


def assert_401(response, fragment: str = ""):
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert error == {"message": error["message"], "type": "authentication_error", "param": None,
                     "code": "invalid_api_key"}
    assert fragment in error["message"]
    for key in ALL_KEYS + [WRONG_KEY]:
        assert key not in response.text
    assert response.headers.get("x-request-id")  # the request middleware ran around it
    return error["message"]


def settings_for(repository, **overrides) -> Settings:
    return Settings(repository=repository, models=["translation", "gpt"], max_timeout_ms=60_000, **overrides)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys.txt"
    path.write_text(KEY_FILE)
    return path


@pytest.fixture(scope="module")
def open_client(tiny_repository, serving):
    with serving(settings_for(tiny_repository)) as client:
        yield client


@pytest.fixture(scope="module")
def client(tiny_repository, serving, key_file):
    with serving(settings_for(tiny_repository, api_keys=LIST_KEYS, api_keys_file=key_file)) as client:
        yield client


# --- no keys: nothing changes -------------------------------------------------------------------------------

def test_no_keys_everything_is_open(open_client):
    for method, path, payload in PROTECTED:
        assert call(open_client, method, path, payload).status_code == 200, path
        # a header, even a wrong one, is ignored when there are no keys
        assert call(open_client, method, path, payload, bearer(WRONG_KEY)).status_code == 200, path
    for path in OPEN_PATHS:
        assert open_client.get(path).status_code == 200, path
    assert open_client.get("/v1/no-such-route").status_code == 404


# --- keys configured ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,payload", PROTECTED)
def test_protected_routes_need_a_key(client, method, path, payload):
    assert "missing API key" in assert_401(call(client, method, path, payload))
    assert "invalid API key" in assert_401(call(client, method, path, payload, bearer(WRONG_KEY)))
    for key in ALL_KEYS:  # each key of the list and of the file
        response = call(client, method, path, payload, bearer(key))
        assert response.status_code == 200, (key, response.text)


def test_every_path_under_v1_and_v2_is_protected(client):
    """Routes added later under /v1/ and /v2/ (OpenAI-compatible, Open Inference Protocol) are covered at once:
    without a key even an unknown path is 401, with one it is the router's 404."""
    for path in ("/v1/no-such-route", "/v1/chat/completions", "/v2/models/gpt/infer", "/v2", "/v1"):
        assert_401(client.get(path))
        # with the key: the router's answer (404 unknown, 405 POST only, 200 the Open Inference Protocol's /v2)
        assert client.get(path, headers=bearer(LIST_KEYS[0])).status_code in (200, 404, 405), path
    assert_401(client.options("/v1/models"))  # CORS preflights are not special-cased


def test_open_paths_need_no_key(client):
    for path in OPEN_PATHS:
        assert client.get(path).status_code == 200, path
        assert client.get(path, headers=bearer(WRONG_KEY)).status_code == 200, path


@pytest.mark.parametrize("value,fragment", [
    (f"Basic {LIST_KEYS[0]}", "unsupported Authorization scheme"),
    ("Basic dXNlcjpwYXNz", "unsupported Authorization scheme"),
    (LIST_KEYS[0], "unsupported Authorization scheme"),  # the key alone, no scheme
    ("Bearer", "missing API key after 'Bearer'"),
    ("Bearer    ", "missing API key after 'Bearer'"),
    ("", "unsupported Authorization scheme"),
    (f"Bearer {LIST_KEYS[0].upper()}", "invalid API key"),  # the key is case-sensitive
    (f"Bearer {LIST_KEYS[0]}x", "invalid API key"),
    (f"Bearer {LIST_KEYS[0][:-1]}", "invalid API key"),
    (f"Bearer {LIST_KEYS[0]} {LIST_KEYS[1]}", "invalid API key"),
    (f"Token {LIST_KEYS[0]}", "unsupported Authorization scheme"),
])
def test_malformed_authorization_is_401(client, value, fragment):
    assert fragment in assert_401(client.get("/v1/models", headers={"Authorization": value}))


@pytest.mark.parametrize("value", [f"bearer {LIST_KEYS[0]}", f"BEARER {LIST_KEYS[1]}", f"Bearer   {FILE_KEYS[0]}",
                                   f"  Bearer {FILE_KEYS[1]}  "])
def test_scheme_is_case_insensitive_and_spaces_are_tolerated(client, value):
    """RFC 7235 2.1: the auth-scheme is case-insensitive; the key itself is compared exactly."""
    assert client.get("/v1/models", headers={"Authorization": value}).status_code == 200


def test_the_key_goes_in_authorization_only(client):
    assert_401(client.get("/v1/models", headers={"X-API-Key": LIST_KEYS[0]}))
    assert_401(client.get(f"/v1/models?api_key={LIST_KEYS[0]}"))
    assert_401(client.get("/v1/models", headers={"Proxy-Authorization": f"Bearer {LIST_KEYS[0]}"}))


def test_more_than_one_authorization_header_is_401(client):
    headers = [("Authorization", f"Bearer {LIST_KEYS[0]}"), ("Authorization", f"Bearer {WRONG_KEY}")]
    assert "more than one" in assert_401(client.get("/v1/models", headers=headers))


def test_websocket_under_v1_is_closed_without_a_key(client):
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/v1/models"):
        pass
    assert closed.value.code == 1008
    # with a key: the router's "no such websocket route"
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/v1/models",
                                                                                 headers=bearer(LIST_KEYS[0])):
        pass
    assert closed.value.code != 1008


def test_rejections_are_logged_and_counted_by_the_request_middleware(client, caplog):
    """The API key middleware runs inside the request middleware: a 401 still has its access line and its
    request duration series (by status; 401 is no failure reason)."""
    caplog.set_level(logging.INFO, logger="tserve.access")
    client.get("/v1/models", headers={"X-Request-ID": "auth-rejected-1"})
    lines = [record.fields for record in caplog.records if getattr(record, "fields", {}).get("request_id") ==
             "auth-rejected-1"]
    assert lines and lines[0]["status"] == 401 and lines[0]["path"] == "/v1/models"
    metrics = client.get("/metrics").text
    assert any(line.startswith("tserve_request_duration_seconds_count{") and 'endpoint="/v1/models"' in line
               and 'status="401"' in line for line in metrics.splitlines())


def test_keys_never_in_logs_nor_metrics(client, caplog):
    caplog.set_level(logging.DEBUG)
    for key in ALL_KEYS + [WRONG_KEY]:
        for method, path, payload in PROTECTED:
            call(client, method, path, payload, bearer(key))
        client.get("/v1/models", headers={"Authorization": f"Basic {key}"})
        client.get("/metrics", headers=bearer(key))
    assert caplog.records  # the access lines were captured
    formatter = JSONFormatter()
    logged = caplog.text + "\n".join(formatter.format(record) for record in caplog.records)
    metrics = client.get("/metrics").text
    for key in ALL_KEYS + [WRONG_KEY]:
        assert key not in logged
        assert key not in metrics


def test_every_key_is_compared_with_compare_digest(client, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for key, status in [(ALL_KEYS[0], 200), (ALL_KEYS[-1], 200), (WRONG_KEY, 401)]:
        calls.clear()
        assert client.get("/v1/models", headers=bearer(key)).status_code == status
        assert len(calls) == len(ALL_KEYS), key  # every key, also after a match on the first
        assert set(calls) == {(bytes, bytes)}
    calls.clear()
    client.get("/v1/models")  # no header: nothing to compare
    client.get("/health/live", headers=bearer(WRONG_KEY))  # an open path: no comparison
    assert calls == []


# --- configuration ------------------------------------------------------------------------------------------

def test_keys_from_a_file_with_comments_and_blank_lines(key_file):
    assert load_api_keys(Settings(api_keys_file=key_file)) == frozenset(FILE_KEYS)
    assert load_api_keys(Settings(api_keys=LIST_KEYS, api_keys_file=key_file)) == frozenset(ALL_KEYS)
    assert load_api_keys(Settings(api_keys=[FILE_KEYS[0]], api_keys_file=key_file)) == frozenset(FILE_KEYS)
    assert load_api_keys(Settings()) == frozenset()


def test_keys_from_the_environment(monkeypatch, key_file):
    monkeypatch.setenv("TSERVE_API_KEYS", json.dumps(LIST_KEYS))
    monkeypatch.setenv("TSERVE_API_KEYS_FILE", str(key_file))
    settings = Settings(_env_file=None)
    assert settings.api_keys == LIST_KEYS and settings.api_keys_file == key_file
    assert load_api_keys(settings) == frozenset(ALL_KEYS)


def test_default_is_no_keys(monkeypatch):
    monkeypatch.delenv("TSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("TSERVE_API_KEYS_FILE", raising=False)
    settings = Settings(_env_file=None)
    assert settings.api_keys == [] and settings.api_keys_file is None


@pytest.mark.parametrize("make_settings,setting,fragment", [
    (lambda tmp: Settings(api_keys=["short-key-15chr"]), "TSERVE_API_KEYS", "at least 16 characters"),
    (lambda tmp: Settings(api_keys=[LIST_KEYS[0], "   "]), "TSERVE_API_KEYS", "at least 16 characters"),
    (lambda tmp: Settings(api_keys=["key with spaces inside"]), "TSERVE_API_KEYS", "visible ASCII"),
    (lambda tmp: Settings(api_keys=["schlüssel-0123456789"]), "TSERVE_API_KEYS", "visible ASCII"),
    (lambda tmp: Settings(api_keys_file=tmp / "missing.txt"), "TSERVE_API_KEYS_FILE", "cannot read"),
    (lambda tmp: Settings(api_keys_file=tmp), "TSERVE_API_KEYS_FILE", "cannot read"),  # a directory
    (lambda tmp: Settings(api_keys_file=write(tmp / "short.txt", f"# ok\n{FILE_KEYS[0]}\nshort-key-15chr\n")),
     "line 3", "at least 16 characters"),
    (lambda tmp: Settings(api_keys_file=write(tmp / "empty.txt", "# nothing yet\n\n")),
     "TSERVE_API_KEYS_FILE", "holds no API key"),
    (lambda tmp: Settings(api_keys_file=write(tmp / "latin1.txt", b"\xff\xfe-not-utf8-key-0123")),
     "TSERVE_API_KEYS_FILE", "cannot read"),
])
def test_bad_key_settings_fail_at_app_creation(tmp_path, tiny_repository, make_settings, setting, fragment):
    settings = make_settings(tmp_path).model_copy(update={"repository": tiny_repository})
    with pytest.raises(ApiKeyConfigError) as error:
        create_app(settings)
    message = str(error.value)
    assert setting in message and fragment in message, message
    assert "short-key-15chr" not in message and FILE_KEYS[0] not in message  # never the key itself


def write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_configuration_log_names_no_key(caplog):
    caplog.set_level(logging.DEBUG)
    middleware = ApiKeyMiddleware(app=None, keys=ALL_KEYS)
    assert "4 key(s)" in caplog.text
    assert not any(key in caplog.text for key in ALL_KEYS)
    assert not any(key.encode() in repr(vars(middleware)).encode() for key in ALL_KEYS)  # only digests kept
    caplog.clear()
    ApiKeyMiddleware(app=None, keys=[])  # no keys: a silent pass-through
    assert caplog.text == ""


def test_protected_paths_and_root_path():
    assert all(auth.is_protected(p) for p in ("/v1", "/v1/", "/v1/models", "/v2", "/v2/models/x/infer", "/tokenize",
                                              "/detokenize", "/tokenizer_info"))
    assert not any(auth.is_protected(p) for p in ("/v10/models", "/v1x", "/health/live", "/metrics", "/docs",
                                                   "/openapi.json", "/redoc", "/", "", "/tokenizex"))
    assert auth._route_path({"path": "/api/v1/models", "root_path": "/api"}) == "/v1/models"
    assert auth._route_path({"path": "/v1/models", "root_path": "/api"}) == "/v1/models"
    assert auth._route_path({"path": "/apiv1/models", "root_path": "/api"}) == "/apiv1/models"
