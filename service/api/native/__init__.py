"""The native JSON API: `/v1/translate`, `/v1/generate` (protocol + text router) and `/v1/classify` (images router)."""
