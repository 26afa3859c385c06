"""The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (protocol, router, render, chat
template, error shape)."""
