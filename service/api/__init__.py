"""The APIs the service speaks, one package each (native JSON, OpenAI-compatible, Open Inference Protocol), plus
health/metrics (`admin`) and model control (`control`). A router validates, maps its request to a serving call
(`to_params`) and renders the result; none imports another."""
