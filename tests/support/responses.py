"""What the tests read from the native API's responses: its error body, `{"error": {"type", "message"}}`."""

from __future__ import annotations


def error_of(response, status: int) -> dict:
    """The native error of `response`, after checking its status and that the body has exactly the error's shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}
    return body["error"]
