"""The HTTP shell around every API: request middleware, API keys, per-API route classes and error rendering, uvicorn
protocol limits, body parsing and SSE responses."""
