"""The baseline of `bench/bench_http.py`: the GPT endpoint a user would otherwise write with transformers.

A plain FastAPI app with one `POST /generate` route that calls Hugging Face `GPT2LMHeadModel.generate()` once per
request: greedy, batch 1, no batching across requests. The route is a plain `def`, so FastAPI runs it in its
threadpool (AnyIO, 40 threads by default) and concurrent requests call `generate()` concurrently on the shared
model, as a naive user's service would. The model has the GPT release preset's size (`models.config`,
`PRESETS["gpt"]["release"]`: n_embd 256, 6 layers, 4 heads, n_inner 1024, context 256, byte vocabulary of 257)
with random weights (seed 0), and the same byte tokenizer as the service (`models.tokenization`).

Fairness (see bench_http.py): `min_new_tokens == max_new_tokens`, so EOS is masked and every request generates
exactly `max_new_tokens` tokens; `--threads` torch intra-op threads (inter-op 1) like the service's ONNX Runtime
sessions; idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, like the service's allow_spinning=0) unless --spin.

    POST /generate {"prompt": str, "max_new_tokens": int}
        -> {"text": str, "prompt_tokens": int, "completion_tokens": int}
    GET /health/ready -> 200 once the model is built and warmed up (it is, before the server accepts connections)

Run: python bench/baseline_server.py --port 8100 --threads 2   (bench_http.py starts it itself)
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import BaseModel, Field


class GenerateBody(BaseModel):  # at module level: FastAPI must resolve it as the request body
    prompt: str = Field(..., min_length=1)
    max_new_tokens: int = Field(64, ge=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--spin", action="store_true", help="let idle OpenMP threads busy-wait (library default)")
    # the model's size: the GPT release preset's unless given (bench_http.py passes the served model's)
    parser.add_argument("--vocab-size", type=int, default=None, help="vocabulary (default 257: bytes + EOS)")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--n-heads", type=int, default=None)
    parser.add_argument("--d-ff", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="largest max_new_tokens accepted")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before torch loads OpenMP: the thread count and wait policy are read once, at load time.
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE" if args.spin else "PASSIVE"
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    import transformers
    import uvicorn
    from fastapi import FastAPI, HTTPException

    from models.config import get_preset, with_overrides
    from models.tokenization import ENDOFTEXT_ID, build_byte_tokenizer

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    transformers.logging.set_verbosity_error()

    preset = with_overrides(get_preset("gpt", "release")[0], vocab_size=args.vocab_size,
                            context_length=args.context_length, d_model=args.d_model, n_layers=args.n_layers,
                            n_heads=args.n_heads, d_ff=args.d_ff)
    config = transformers.GPT2Config(
        vocab_size=preset.vocab_size, n_positions=preset.context_length, n_embd=preset.d_model,
        n_layer=preset.n_layers, n_head=preset.n_heads, n_inner=preset.d_ff, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokenizer = build_byte_tokenizer()

    app = FastAPI(title="baseline: transformers generate() per request")

    def run_generate(prompt: str, max_new_tokens: int) -> dict:
        ids = tokenizer.encode(prompt).ids
        if len(ids) + max_new_tokens > preset.context_length:
            raise HTTPException(400, f"prompt ({len(ids)} tokens) + max_new_tokens exceeds the context")
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=ENDOFTEXT_ID, pad_token_id=0, use_cache=True)
        new = out[0, input_ids.shape[1]:].tolist()
        return {"text": tokenizer.decode(new), "prompt_tokens": len(ids), "completion_tokens": len(new)}

    @app.post("/generate")
    def generate(body: GenerateBody) -> dict:  # a plain def: FastAPI runs it in its threadpool
        if body.max_new_tokens > args.max_new_tokens:
            raise HTTPException(400, f"max_new_tokens exceeds {args.max_new_tokens}")
        return run_generate(body.prompt, body.max_new_tokens)

    @app.get("/health/ready")
    def ready() -> dict:
        return {"status": "ready"}

    run_generate("Warm up.", 4)  # first-call costs (kernels, allocator) out of the measurements
    print(f"baseline ready: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {preset}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
