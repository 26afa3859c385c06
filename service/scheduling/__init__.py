"""Schedulers between the HTTP layer and the engines: continuous batching (text), dynamic batching (images)."""
