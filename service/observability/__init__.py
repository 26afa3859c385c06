"""Observability: Prometheus metrics (`metrics`), OpenTelemetry tracing (`tracing`, with `request_span` and
`job_spans`) and JSON logs (`logs`)."""
