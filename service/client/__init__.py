"""Tools for the project's own clients (tests, benchmarks, export.verify_served, the locustfile): a `python -m service`
subprocess (`launcher`, `processes`) and the server-sent event wire format (`sse`, standard library only)."""
