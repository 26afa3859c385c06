"""Service configuration, from the environment (prefix `TSERVE_`) or a `.env` file, with pydantic-settings.

Every knob an operator may turn lives here: the model repository, provider and threads, batching and queueing,
deadlines, input limits, logging and shutdown. Example: `TSERVE_GPT_MAX_BATCH_ROWS=64 make serve`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from service.models.variants import parse_pins
from service.per_model import parse_per_model
from service.repository import MODEL_NAME_PATTERN
from service.response_cache.cache import NONE


ENV_PREFIX = "TSERVE_"


def env_list(value: object) -> object:
    """A list from the environment, written either way an operator would: a JSON list (`'["gpt","vit:4"]'`) or
    comma-separated names (`gpt,vit:4`); blank entries dropped. Anything else (a list from code) passes as is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON list ({error.msg} at character {error.pos}); write it as "
                             f"'[\"a\",\"b\"]' or a,b") from None
    return [item.strip() for item in text.split(",") if item.strip()]


# a list field read from one environment variable as `env_list` parses it
EnvList = Annotated[list[str], NoDecode]
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what the redis client's from_url reads


class SettingsInvalid(ValueError):
    """The configuration cannot be used: one line per bad setting, each naming its environment variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=".env", extra="ignore")

    # where the models are, and which to load (none = every model in the repository; else "name" or
    # "name:version", comma-separated or a JSON list)
    repository: Path = Path("model_repository")
    models: EnvList = Field(default_factory=list)
    # set: the repository is one model's folder (its version folders directly under it), served under this name, as
    # KServe hands a model over (storageUri copied to /mnt/models, the InferenceService's name; deploy/kserve/);
    # `python -m service --model_name NAME --model_dir DIR` sets it and the repository
    model_name: str = Field("", pattern=f"^(?:{MODEL_NAME_PATTERN.pattern})?$")
    host: str = "127.0.0.1"
    port: int = 8000
    # the Open Inference Protocol over gRPC (service.api.oip.grpc), on the same host; 0 = off
    grpc_port: int = Field(8001, ge=0, le=65535)

    # ONNX Runtime
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # where the text models' KV caches live (service.engines.device_cache): auto = in the GPU's memory under the
    # CUDA provider, numpy on the host under the CPU provider (faster there); device or host to force either
    kv_residence: Literal["auto", "device", "host"] = "auto"
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (all cores)
    ort_spin: bool = False  # busy-wait between ops: only on dedicated cores
    # decoding steps of at most this many rows run on a one-thread session of the decoder graph (0 = never):
    # waking a second thread for each small op costs more than it saves (service.engines.runtime.OneThreadSession);
    # unset: each kind's own (service.models.kinds: the GPT's one-row steps, no translation steps)
    single_thread_rows: int | None = Field(None, ge=0)
    # the MatMuls that read one input (an attention's Q/K/V projections) run as one, fused when the graphs load
    # (service.engines.projection_fusion): the same outputs bit for bit, fewer kernel calls; false = as exported
    fuse_projections: bool = True
    # the variant each model runs (service.models.variants): auto = the fastest on this host of those its version
    # offers, timed at start-up (cached in calibration_cache per CPU); stored = as the repository holds it; fp32,
    # int8, fp32+gqa or int8+gqa (the step graph's attention as GroupQueryAttention) for every model; or per model:
    # gpt=int8+gqa,translation=stored (the others: auto)
    variant: str = "auto"
    # the batch sizes `auto` times the variants at: one row and the largest batch (latency and throughput, a server's
    # mix), or the largest batch only (throughput: what an offline batch job keeps full, `python -m service.batch`)
    calibrate_for: Literal["latency-and-throughput", "throughput"] = "latency-and-throughput"
    # the calibration timings, kept between starts ("" = none kept: every start measures)
    calibration_cache: str = str(Path("~/.cache/tserve/calibration.json"))

    # automatic prefix caching for the GPT (service.engines.prefix_cache): prompt K/V kept in blocks of 16 tokens, so
    # that a prompt starting like an earlier one computes only the rest; the same outputs either way
    prefix_cache: bool = True
    prefix_cache_mb: int = Field(256, ge=1)  # its memory per loaded GPT version, least recently used evicted
    # draft-free speculative decoding for greedy GPT requests (service.scheduling.speculation): ngram = drafts from
    # the row's own context, verified in one multi-token pass. Off by default: that pass may differ from plain steps
    # in a logit's last bits, which flips a near-tie now and then (docs/speculation.md has the measurement)
    speculation: Literal["off", "ngram"] = "off"
    speculation_max_draft: int = Field(8, ge=1)  # the longest draft (it adapts below this to the acceptance)
    # a step speculates only while its batch holds at most this many rows (above it a verify pass costs more than
    # the tokens it saves: measured in docs/speculation.md)
    speculation_max_rows: int = Field(1, ge=1)

    # the response cache (service.response_cache, docs/response_cache.md): a repeated request answered from a cache of
    # whole answers, keyed by a hash of everything that decides the answer. Off by default, as Triton's: the models it
    # is on for (names, comma-separated or a JSON list; `all`; `none`: off for every model, even one whose config.json
    # turns it on), bounded in bytes in this process (least recently used evicted) or shared by every replica in
    # Redis (redis://host:6379/0; "" = local), each Redis command bounded by the timeout (then served uncached)
    response_cache: EnvList = Field(default_factory=list)
    response_cache_mb: int = Field(128, ge=1)
    response_cache_redis_url: str = ""
    response_cache_redis_timeout_ms: float = Field(50.0, gt=0)

    # iteration-level batching for the text models: rows (beams count as rows) decoded together per step
    translation_max_batch_rows: int = Field(64, ge=1)
    gpt_max_batch_rows: int = Field(64, ge=1)
    max_prefill_requests: int = Field(16, ge=1)  # requests admitted into one prompt/encoder pass
    # decoding loops per text model, each with its own batch of up to *_max_batch_rows rows, over one queue and one
    # engine: while one batch runs in ONNX Runtime the other's searches run in Python (service.scheduling.continuous)
    decoding_workers: int = Field(2, ge=1)
    # dynamic batching for the ViT (Triton's knobs)
    vit_max_batch_size: int = Field(64, ge=1)
    vit_max_queue_delay_ms: float = Field(5.0, ge=0)
    vit_batching: bool = True
    # bounded queues: requests waiting for admission, per model (beyond this: 429 with Retry-After)
    max_queue_size: int = Field(256, ge=1)
    # request priority (service.scheduling.priority): levels 0 (most urgent) to priority_levels - 1, served lowest
    # first; the level of a request that gives none, for every model or per model ("1", "1,vit=0"); after
    # priority_max_wait_s in a queue any request is served first (no level starves)
    priority_levels: int = Field(3, ge=1, le=1000)
    default_priority: str = "1"
    priority_max_wait_s: float = Field(10.0, gt=0)
    # rows beyond *_max_batch_rows that only requests more urgent than their model's default may take, so that they
    # join a full batch at its next step (running requests are never preempted)
    priority_headroom_rows: int = Field(8, ge=0)
    # forced decoding (`POST /v1/translate/score`) runs beside the schedulers: at most this many requests per model
    # version at once (beyond this: 429 with Retry-After)
    max_scoring_requests: int = Field(4, ge=1)

    # deadlines: default when a request gives no timeout_ms, and the most a request may ask for
    default_timeout_ms: int = Field(30_000, ge=1)
    max_timeout_ms: int = Field(120_000, ge=1)

    # input limits
    max_text_chars: int = Field(2_000, ge=1)
    max_texts: int = Field(32, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    max_num_beams: int = Field(8, ge=1)
    max_images: int = Field(64, ge=1)
    max_image_bytes: int = Field(5_000_000, ge=1)
    max_image_pixels: int = Field(16_000_000, ge=1)
    max_body_bytes: int = Field(40_000_000, ge=1)
    # the tokenizer routes' own bound (service.api.tokenize): characters of a prompt to /tokenize, ids to
    # /detokenize; far above a generation prompt (max_text_chars), as lm-eval tokenizes whole documents for
    # perplexity (tinyshakespeare's validation split: 111,540 characters), and ~110 MB of tokenizer memory at most
    max_tokenize_chars: int = Field(500_000, ge=1)
    # image decoding: a bounded pool of decoder threads (0 = one per CPU core), a memory budget for the pixels
    # being decoded at once by all requests together (a decode waits for room, up to its deadline), and a bound
    # on the pixels of all the images of one request
    image_decode_threads: int = Field(0, ge=0)
    image_decode_budget_bytes: int = Field(256 * 2**20, ge=1)
    max_request_pixels: int = Field(64_000_000, ge=1)

    # slow and oversized clients (HTTP/1.1): the request line and headers must arrive within header_timeout_s of
    # the request's first byte (or of the connection opening) and stay within max_header_bytes / max_header_count
    # (408 / 431 and the connection is closed); the body must arrive within body_timeout_s of the headers (408)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_header_bytes: int = Field(16_384, ge=256)
    max_header_count: int = Field(100, ge=1)

    # model control (Triton's explicit mode): load and unload versions through /v2/repository without a restart
    model_control: bool = False

    # logging and shutdown
    log_level: str = "INFO"
    log_format: Literal["json", "text"] = "json"
    # after SIGTERM: keep serving (ready = 503) this long before stopping, so that load balancers polling
    # readiness (Kubernetes: every 5 s, deploy/k8s) take the replica out before its listener closes
    drain_delay_s: float = Field(5.0, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0)  # then let in-flight requests finish for at most this long

    # optional API keys (service.http.auth): when any is configured, every request under /v1/ and /v2/ and the
    # tokenizer routes needs `Authorization: Bearer <key>`; health, metrics and the API docs stay open. The keys
    # are the union of api_keys (comma-separated or a JSON list: TSERVE_API_KEYS='["key-1","key-2"]') and
    # api_keys_file (one key per line; blank lines and lines starting with # ignored). None at all = no
    # authentication. Each key: at least 16 characters
    api_keys: EnvList = Field(default_factory=list)
    api_keys_file: Path | None = None

    @field_validator("models", "api_keys", "response_cache", mode="before")
    @classmethod
    def _env_list(cls, value: object) -> object:
        return env_list(value)

    @field_validator("response_cache")
    @classmethod
    def _cached_models(cls, models: list[str]) -> list[str]:
        if NONE in models and len(models) > 1:
            raise ValueError(f"`{NONE}` stands alone: it turns the cache off for every model")
        return models

    @field_validator("response_cache_redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if url and not url.startswith(REDIS_SCHEMES):
            raise ValueError(f"a Redis URL starts with {', '.join(REDIS_SCHEMES)}")
        return url

    @field_validator("variant")
    @classmethod
    def _variant_pins(cls, value: str) -> str:
        parse_pins(value)  # a ValueError names the bad entry
        return value

    @model_validator(mode="after")
    def _priority_defaults(self) -> Settings:
        self.default_priorities  # a ValueError names the bad entry
        return self

    @property
    def default_priorities(self) -> dict[str, int]:
        """TSERVE_DEFAULT_PRIORITY -> model (or `service.per_model.ALL_MODELS`) -> level."""
        def level(text: str) -> int:
            if not text.isdigit() or int(text) >= self.priority_levels:
                raise ValueError(f"a level from 0 to {self.priority_levels - 1} (TSERVE_PRIORITY_LEVELS)")
            return int(text)

        return parse_per_model(self.default_priority, "TSERVE_DEFAULT_PRIORITY", level)

    @property
    def variant_pins(self) -> dict[str, str]:
        return parse_pins(self.variant)

    @property
    def calibration_cache_path(self) -> Path | None:
        return Path(self.calibration_cache).expanduser() if self.calibration_cache else None


def load_settings(overrides: dict[str, object] | None = None) -> Settings:
    """The settings from the environment, `overrides` (setting -> value: the command line's) over it;
    `SettingsInvalid` naming every bad variable (and what is wrong with it) instead of pydantic's traceback."""
    try:
        return Settings(**(overrides or {}))
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            field = str(problem["loc"][0]) if problem["loc"] else ""  # the setting; not the item of a list
            lines.append(f"{ENV_PREFIX}{field.upper()}: {problem['msg']} (got {problem.get('input')!r})")
        raise SettingsInvalid("\n".join(lines)) from None
    except SettingsError as error:  # a value pydantic-settings could not even decode
        raise SettingsInvalid(str(error)) from None
    except (OSError, UnicodeDecodeError) as error:  # the .env file, there but unreadable as text
        reason = "it is not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror or repr(error)
        raise SettingsInvalid(f"{Settings.model_config['env_file']}: cannot be read: {reason}") from None


@lru_cache
def get_settings() -> Settings:
    return load_settings()
