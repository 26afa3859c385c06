"""The load test's settings, read once from the environment when the locustfile loads: the task names and their
weights, the request sizes, the think time, the seed; and the fixed request parameters. Standard library only.

Settings (environment):
  TSERVE_DATA_DIR              data folder (default ../shared/data, then ./data, as the project's loaders)
  TSERVE_LOAD_WEIGHTS          task weights, default "translate_greedy=3,translate_beam=2,generate=2,
                               generate_stream=2,classify=3,openai_completion=1,openai_completion_stream=1,
                               openai_chat=1,openai_chat_stream=1,oip_translate=1,oip_generate=1,
                               oip_classify=1,grpc_generate_stream=1,grpc_classify=1" (a name left out:
                               weight 0)
  TSERVE_LOAD_THINK_S          mean wait between a user's requests, seconds (default 0.1; 0 = back to back)
  TSERVE_LOAD_NUM_BEAMS        beam width of `translate beam` (default 4)
  TSERVE_LOAD_PROMPT_CHARS     GPT prompt length in characters = tokens, byte-level (default 16)
  TSERVE_LOAD_MAX_NEW_TOKENS   GPT max_new_tokens, and max_tokens of the OpenAI completions (default 32; chat:
                               17 fewer, CHAT_TEMPLATE_TOKENS). Prompt + new tokens must fit the model's context: 64 tokens
                               for the tiny preset, 256 for release
  TSERVE_LOAD_MAX_IMAGES       images per classify request, uniformly 1..N (default 4)
  TSERVE_LOAD_TIMEOUT_MS       timeout_ms sent with every native request (default: none, the server's default; the
                               OpenAI routes have no such field and always get the server's default)
  TSERVE_LOAD_GPT_MODEL        `model` of the OpenAI requests (default gpt)
  TSERVE_LOAD_GRPC_HOST        host:port of the gRPC tasks (default: the HTTP host's name, port 8001)
  TSERVE_LOAD_API_KEY          sent as `Authorization: Bearer <key>` on every request when set (for a service
                               with TSERVE_API_KEYS / TSERVE_API_KEYS_FILE)
  TSERVE_LOAD_SEED             seed of the input choices (default 0)
"""

from __future__ import annotations

import os

DEFAULT_WEIGHTS = ("translate_greedy=3,translate_beam=2,generate=2,generate_stream=2,classify=3,"
                   "openai_completion=1,openai_completion_stream=1,openai_chat=1,openai_chat_stream=1,"
                   "oip_translate=1,oip_generate=1,oip_classify=1,grpc_generate_stream=1,grpc_classify=1")
OPENAI_TASKS = ("openai_completion", "openai_completion_stream", "openai_chat", "openai_chat_stream")
OIP_TASKS = ("oip_translate", "oip_generate", "oip_classify")  # the Open Inference Protocol (KServe v2), JSON
GRPC_TASKS = ("grpc_generate_stream", "grpc_classify")  # the Open Inference Protocol over gRPC (load_grpc.py)
TASKS = ("translate_greedy", "translate_beam", "generate", "generate_stream", "classify", *OPENAI_TASKS, *OIP_TASKS,
         *GRPC_TASKS)
# service.api.openai.chat_template: "ROMEO:\n" before the user's text, "\n\nJULIET:\n" after it (byte-level: 1 token a byte);
# it may strip the text and merge blank lines in it, never add to it
CHAT_TEMPLATE_TOKENS = len("ROMEO:\n" + "\n\nJULIET:\n")
END_OF_TURN = "\n\n"  # a chat answer ends at the first blank line, which is not part of it


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """The integer setting `name` (`default` when unset); below `minimum` is an error."""
    value = int(os.environ.get(name, default))
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    return value


def parse_weights(text: str) -> dict[str, int]:
    """TSERVE_LOAD_WEIGHTS ("NAME=INT,...") as a weight per task, 0 for a task left out; all 0 is an error."""
    weights = dict.fromkeys(TASKS, 0)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in weights or not value.strip().isdigit():
            raise ValueError(f"TSERVE_LOAD_WEIGHTS: bad item {item!r}; expected NAME=INT with NAME in {TASKS}")
        weights[name] = int(value)
    if not any(weights.values()):
        raise ValueError("TSERVE_LOAD_WEIGHTS: every weight is 0")
    return weights


DATA_DIR = os.environ.get("TSERVE_DATA_DIR") or None  # None: the loaders' defaults (../shared/data, ./data)
WEIGHTS = parse_weights(os.environ.get("TSERVE_LOAD_WEIGHTS") or DEFAULT_WEIGHTS)  # unset or empty: the default
THINK_S = float(os.environ.get("TSERVE_LOAD_THINK_S", "0.1"))
NUM_BEAMS = env_int("TSERVE_LOAD_NUM_BEAMS", 4, minimum=2)
PROMPT_CHARS = env_int("TSERVE_LOAD_PROMPT_CHARS", 16, minimum=1)
MAX_NEW_TOKENS = env_int("TSERVE_LOAD_MAX_NEW_TOKENS", 32, minimum=1)
CHAT_MAX_TOKENS = max(1, MAX_NEW_TOKENS - CHAT_TEMPLATE_TOKENS)  # the chat prompt + answer fit as generate's do
MAX_IMAGES = env_int("TSERVE_LOAD_MAX_IMAGES", 4, minimum=1)
TIMEOUT_MS = env_int("TSERVE_LOAD_TIMEOUT_MS", 0)
SEED = env_int("TSERVE_LOAD_SEED", 0)
GPT_MODEL = os.environ.get("TSERVE_LOAD_GPT_MODEL", "gpt")
GRPC_HOST = os.environ.get("TSERVE_LOAD_GRPC_HOST", "").strip() or None  # None: load_grpc.default_target
API_KEY = os.environ.get("TSERVE_LOAD_API_KEY", "").strip() or None
N_INPUTS = 500  # distinct sentences / prompts / images kept in memory

# Fixed request parameters (not settings): sampled generation, so that the load resembles users' requests.
SAMPLING = {"temperature": 0.8, "top_k": 40}  # native /v1/generate and the OIP generate
OPENAI_SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # the OpenAI-compatible requests
SEEDS = 2**31  # each sampled request draws its seed from [0, SEEDS)
CLASSIFY_TOP_K = 3  # predictions asked for (and checked) per image of a classify request


def as_dict() -> dict:
    """The settings as recorded in `<csv prefix>_extra.json` (whether an API key is sent, never the key)."""
    return {"weights": WEIGHTS, "think_s": THINK_S, "num_beams": NUM_BEAMS, "prompt_chars": PROMPT_CHARS,
            "max_new_tokens": MAX_NEW_TOKENS, "chat_max_tokens": CHAT_MAX_TOKENS, "max_images": MAX_IMAGES,
            "timeout_ms": TIMEOUT_MS or None, "seed": SEED, "gpt_model": GPT_MODEL, "api_key": API_KEY is not None}
