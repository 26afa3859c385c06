"""Every Prometheus metric of the service, declared in one place (vLLM's layout): namespaced `tserve_`,
unit-suffixed, explicit buckets. Observed where the work happens (routes, schedulers, model loading).

Labels: `model`, `version`, and `mode` = greedy | beam | sample (text) or classify (images). The queue, running and
row gauges are bound to the schedulers' state (`service.scheduling.queueing.bind_gauges`), read at scrape time.
Each app instance owns its own registry, so tests and several apps in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
# a response cache lookup: a local hit is tens of microseconds, a Redis one a network round trip (bounded at 50 ms)
CACHE_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
BATCH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# The `mode` label's values: how a text request decodes (what each kind offers: `service.models.kinds`), `score`
# for forced decoding of given targets, or `classify` for an image request.
GREEDY, BEAM, SAMPLE, SCORE, CLASSIFY = "greedy", "beam", "sample", "score", "classify"

# `unloaded`: a request whose version was unloaded (model control) before it finished (a 503, as `unavailable`)
FAILURE_REASONS = ("bad_input", "unauthorized", "queue_full", "timeout", "cancelled", "internal", "unavailable",
                   "unloaded")
# A failed request's reason by its final status (unless the request set its own); 499 = the client went away. A gRPC
# call is counted by the HTTP status of its error (`service.api.oip.grpc.calls`), so one table serves every API.
FAILURE_BY_STATUS = {400: "bad_input", 401: "unauthorized", 403: "bad_input", 404: "bad_input", 405: "bad_input",
                     408: "bad_input", 413: "bad_input", 415: "bad_input", 422: "bad_input", 429: "queue_full",
                     499: "cancelled", 500: "internal", 501: "bad_input", 503: "unavailable", 504: "timeout"}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "tserve_request_duration_seconds", "Time from receiving a request to its last byte, by endpoint, API "
            "(native | openai | oip | oip-grpc) and status (a gRPC call's: the HTTP status of its error).",
            ["endpoint", "api", "model", "version", "mode", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "tserve_queue_wait_seconds", "Time a request waited before its first batch (prefill or image batch).",
            ["model", "version", "mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.priority_queue_wait = Histogram(
            "tserve_priority_queue_wait_seconds", "Time a request waited before its first batch, by its priority "
            "level (0 the most urgent).", ["model", "version", "priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_refusals = Counter(
            "tserve_queue_refusals", "Requests a full queue refused (429), by priority level and how: full (the "
            "newcomer) or displaced (a waiting one, for a more urgent newcomer).",
            ["model", "version", "priority", "how"], registry=r)
        self.time_to_first_token = Histogram(
            "tserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            ["model", "version", "mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "tserve_inter_token_latency_seconds", "Time between consecutive decoding steps of a request.",
            ["model", "version", "mode"], buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "tserve_prompt_tokens", "Prompt / source tokens processed.", ["model", "version"], registry=r)
        self.generated_tokens = Counter(
            "tserve_generated_tokens", "Tokens generated (every row of a beam search counts).",
            ["model", "version", "mode"], registry=r)
        self.images = Counter("tserve_images", "Images classified.", ["model", "version"], registry=r)
        # n-gram speculation (TSERVE_SPECULATION=ngram), vLLM's names; acceptance rate = accepted / draft tokens
        self.spec_decode_drafts = Counter(
            "tserve_spec_decode_num_drafts", "Drafts verified (one per row of a speculative step that drafted).",
            ["model", "version"], registry=r)
        self.spec_decode_draft_tokens = Counter(
            "tserve_spec_decode_num_draft_tokens", "Draft tokens verified.", ["model", "version"], registry=r)
        self.spec_decode_accepted_tokens = Counter(
            "tserve_spec_decode_num_accepted_tokens", "Draft tokens accepted (kept as generated tokens).",
            ["model", "version"], registry=r)
        # automatic prefix caching (service.engines.prefix_cache), vLLM's prefix_cache_queries / _hits, in tokens
        self.prefix_cache_queries = Counter(
            "tserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model", "version"],
            registry=r)
        self.prefix_cache_hits = Counter(
            "tserve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
            ["model", "version"], registry=r)
        self.prefix_cache_evictions = Counter(
            "tserve_prefix_cache_evictions", "Prefix cache blocks evicted (least recently used, over the budget).",
            ["model", "version"], registry=r)
        self.prefix_cache_bytes = Gauge(
            "tserve_prefix_cache_bytes", "Bytes the prefix cache holds (K/V and logits of its blocks).",
            ["model", "version"], registry=r)
        # the response cache (service.response_cache): whole answers of repeated requests (Triton's cache_hit /
        # cache_miss statistics are read from the lookups)
        self.response_cache_lookup_seconds = Histogram(
            "tserve_response_cache_lookup_seconds", "Response cache lookups by result (hit | miss): the time to find "
            "the entry and rebuild the answer, or to find none.", ["model", "version", "result"],
            buckets=CACHE_LOOKUP_BUCKETS, registry=r)
        self.response_cache_uncacheable = Counter(
            "tserve_response_cache_uncacheable", "Requests to a model with the response cache on whose answer is not a "
            "function of the request (sampling without a seed): never looked up nor stored.", ["model", "version"],
            registry=r)
        self.response_cache_bytes = Gauge(
            "tserve_response_cache_bytes", "Bytes the local response cache holds (keys, answers and their overhead).",
            registry=r)
        self.response_cache_entries = Gauge(
            "tserve_response_cache_entries", "Answers the local response cache holds.", registry=r)
        self.response_cache_evictions = Counter(
            "tserve_response_cache_evictions", "Answers evicted from the local response cache (least recently used, "
            "over TSERVE_RESPONSE_CACHE_MB).", registry=r)
        self.response_cache_redis_errors = Counter(
            "tserve_response_cache_redis_errors", "Redis commands of the response cache that failed or timed out, by "
            "operation (get | set | ping); each request concerned was served uncached.", ["operation"], registry=r)
        self.response_cache_redis_up = Gauge(
            "tserve_response_cache_redis_up", "1 while the response cache's Redis server answers, 0 while it does not "
            "(requests are served uncached); no series without a Redis server.", ["server"], registry=r)
        self.constrained_requests = Counter(
            "tserve_constrained_requests", "Requests whose output is constrained, by kind (json_schema, json_object, "
            "regex, choice, grammar).", ["model", "version", "kind"], registry=r)
        self.constraint_compile_seconds = Histogram(
            "tserve_constraint_compile_seconds", "Time to compile a constraint not in the compiled cache.",
            ["model", "version", "kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.constraint_cache = Counter(
            "tserve_constraint_cache", "Constraints looked up in the compiled cache, by result (hit | miss).",
            ["model", "version", "result"], registry=r)
        self.batch_size = Histogram(
            "tserve_batch_size", "Rows per decoding step (text) or images per batch (ViT).",
            ["model", "version"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram(
            "tserve_batch_seconds", "Seconds of each batch the engine ran: a decoding iteration (the newcomers' "
            "prompt pass and the step) or an image batch.", ["model", "version"], buckets=BATCH_SECONDS_BUCKETS,
            registry=r)
        self.last_batch = Gauge(
            "tserve_last_batch_timestamp_seconds", "Unix time at which the last batch ended.", ["model", "version"],
            registry=r)
        self.queue_depth = Gauge(
            "tserve_queue_depth", "Requests waiting for admission.", ["model", "version"], registry=r)
        self.running_requests = Gauge(
            "tserve_running_requests", "Requests being decoded / classified now.", ["model", "version"], registry=r)
        self.batch_rows = Gauge(
            "tserve_batch_rows", "KV-cache rows held by the running text requests (each beam is a row).",
            ["model", "version"], registry=r)
        self.failures = Counter(
            "tserve_request_failures", "Requests that ended in an error, by reason.",
            ["model", "version", "reason"], registry=r)
        self.rejected_connections = Counter(
            "tserve_rejected_connections",
            "Connections closed before their request reached the app: slow, oversized or unreadable request "
            "heads.",
            ["reason"], registry=r)
        self.model_load_seconds = Gauge(
            "tserve_model_load_seconds", "Time it took to load a model's sessions.", ["model", "version"], registry=r)
        self.model_info = Info("tserve_model", "Loaded models: kind, version, provider and variant: the weights "
                               "that run (chosen_by: pinned, only variant, measured or cached measurement; "
                               "stored_weights, offered_weights), attention and kv_cache for the text models as the "
                               "version's config.json says.", ["model"], registry=r)
        self.variant_seconds = Gauge(
            "tserve_variant_seconds", "Calibration: seconds per generated token (text) or image (ViT) of each "
            "weights variant a loaded version offers, at one row and at the scheduler's largest batch (rows), as "
            "measured on this host to choose the variant that runs.", ["model", "version", "weights", "rows"],
            registry=r)
        self.ready = Gauge("tserve_ready", "1 when every configured model is loaded and the server is not draining.",
                           registry=r)

    def count_request(self, *, endpoint: str, api: str, model: str, version: str, mode: str, status: int,
                      seconds: float, failure_reason: str | None = None) -> None:
        """One finished request: its duration by endpoint, API and status, and its failure (if any) by reason."""
        self.request_duration.labels(endpoint=endpoint, api=api, model=model, version=version, mode=mode,
                                     status=str(status)).observe(seconds)
        reason = failure_reason or FAILURE_BY_STATUS.get(status)
        if reason:
            self.failures.labels(model=model or "none", version=version, reason=reason).inc()

    def declare_model(self, model: str, version: int, decoding_modes: tuple[str, ...]) -> None:
        """Create a loaded model's series at zero, so that rate() and alerts see its first events too: a text
        model's prompt tokens and its generated tokens per decoding mode, or (no decoding modes) an image model's
        images."""
        labels = {"model": model, "version": str(version)}
        for reason in FAILURE_REASONS:
            self.failures.labels(**labels, reason=reason)
        if not decoding_modes:
            self.images.labels(**labels)
            return
        self.prompt_tokens.labels(**labels)
        for mode in decoding_modes:
            self.generated_tokens.labels(**labels, mode=mode)
