"""The serving layer (vLLM's entrypoints split: protocol -> serving -> engine): one module per capability,
shared by every API the service speaks (native JSON, OpenAI-compatible). A module takes validated, protocol-neutral
parameters, builds the searches, submits to the model's scheduler, watches the deadline and the client, and
returns API-neutral results (`outputs.Completion`, probabilities) or a stream of events (`streaming`); the routes
only map their protocol's request to a serving call and its result back.

- generate.py: the GPT (native generate, OpenAI completions and chat)
- translate.py: the translator
- classify.py: the ViT (image decoding in `service.engines.imaging`)
- streaming.py: token streams, incremental detokenisation; outputs.py: `Completion`
- awaiting.py: waiting under the deadline while watching the client, and `run_text_jobs` (submit, await, trace);
  context.py: deadline and metric labels; cached.py: the response cache (a hit answered before any submit)
"""
