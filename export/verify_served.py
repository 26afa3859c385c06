"""What is served equals what was trained: quality measured through the HTTP API against the model card.

    python -m export.verify_served --repository model_repository [--data-dir DIR] [--url URL] [--kinds vit]
        [--variant stored]

Starts `python -m service` on the repository with default settings (service.client.launcher: no inherited TSERVE_*
variable, no .env file; `--variant` its TSERVE_VARIANT), or uses --url, then
- translation: sacreBLEU (cased, 13a) of `POST /v1/translate` (beam 4, the model's default length penalty: the
  one its evaluation chose on val) on Multi30k test_2016_flickr, compared with
  the PyTorch model's `bleu` in metrics.json: must be within 0.2;
- vit: accuracy of `POST /v1/classify` on the 10,000 Fashion-MNIST test images (sent as PNG files), compared with
  the PyTorch model's `test_accuracy`: must be within 0.1 percentage points or one binomial standard error of an
  accuracy on that many images, whichever is larger (`export.tolerances`: 0.27 points on 10,000 images at 92%);
- gpt: nats per character of tinyshakespeare's validation text (the last 10%), its rolling log-likelihood through
  `POST /v1/completions` (`echo` + `logprobs`, `max_tokens` 0: the prompt scored, nothing generated), the text
  tokenized by `POST /tokenize`: windows of the model's context over the end-of-text token and the text, each token
  scored once (as lm-eval's `loglikelihood_rolling`: a window's first token is context, the last window starts a
  full context before its end), compared with the PyTorch model's `val_loss` (nats per token: per character, for
  its byte tokens on this ASCII text): must be within 0.002 nats.
Each check uses the sentences/images/tokens the card was measured on (`test_2016_flickr_sentences`, `test_images`,
`val_tokens`: the whole split for release models, the first N for tiny ones). Models missing from the repository are
skipped.
Prints JSON; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import sacrebleu
from PIL import Image

from models import data
from service.client.launcher import ServiceProcess
from export.tolerances import SERVED_ACCURACY_FLOOR, SERVED_BLEU_TOLERANCE, TOLERANCES, accuracy_tolerance
from service.repository import ModelRepository

# The served GPT's nats per character against its card's validation loss: the graph variants' own tolerance (the
# rolling windows score each token with at most a context's worth of text before it, as the card's windows do).
SERVED_LOSS_TOLERANCE = TOLERANCES["val_loss"]


def _post(client: httpx.Client, path: str, **kwargs) -> dict:
    response = client.post(path, timeout=300, **kwargs)
    response.raise_for_status()
    return response.json()


def verify_translation(url: str, card: dict, data_dir: Path, workers: int = 4) -> dict:
    pairs = data.load_multi30k(data_dir, "test_2016_flickr")[: card.get("test_2016_flickr_sentences")]
    chunks = [pairs[i : i + 32] for i in range(0, len(pairs), 32)]
    with httpx.Client(base_url=url) as client, ThreadPoolExecutor(workers) as pool:
        answers = pool.map(lambda chunk: _post(client, "/v1/translate", json={
            "text": [de for de, _ in chunk], "num_beams": 4, "model": "translation"}), chunks)
        hypotheses = [n_best[0]["text"] for answer in answers for n_best in answer["translations"]]
    served = round(sacrebleu.corpus_bleu(hypotheses, [[en for _, en in pairs]]).score, 2)
    trained = card["bleu"]
    return {"metric": "sacreBLEU test_2016_flickr, beam 4", "sentences": len(pairs), "served": served,
            "trained": trained, "delta": round(served - trained, 2), "ok": abs(served - trained) <= SERVED_BLEU_TOLERANCE}


def verify_vit(url: str, card: dict, data_dir: Path, workers: int = 4) -> dict:
    images, labels = data.load_fashion_mnist(data_dir, "test")
    count = card.get("test_images", len(labels))
    images, labels = images[:count], labels[:count]

    def classify(start: int) -> list[int]:
        files = []
        for i in range(start, min(start + 64, len(images))):
            buffer = io.BytesIO()
            Image.fromarray(images[i]).save(buffer, format="PNG")
            files.append(("files", (f"{i}.png", buffer.getvalue(), "image/png")))
        with httpx.Client(base_url=url) as client:
            answer = _post(client, "/v1/classify", files=files, data={"top_k": "1", "model": "vit"})
        return [p[0]["index"] for p in answer["predictions"]]

    with ThreadPoolExecutor(workers) as pool:
        predicted = [i for batch in pool.map(classify, range(0, len(images), 64)) for i in batch]
    served = round(100.0 * sum(int(p == y) for p, y in zip(predicted, labels)) / len(labels), 2)
    trained = card["test_accuracy"]
    tolerance = accuracy_tolerance(trained, len(labels), SERVED_ACCURACY_FLOOR)
    return {"metric": "Fashion-MNIST test accuracy (%)", "images": len(labels), "served": served,
            "trained": trained, "delta": round(served - trained, 2), "tolerance": tolerance,
            "ok": abs(served - trained) <= tolerance}


def rolling_windows(n_tokens: int, context: int) -> list[tuple[int, int, int]]:
    """lm-eval's rolling windows (`lm_eval.utils.get_rolling_token_windows`, context_len 1) over a sequence of a
    prefix token and `n_tokens` tokens: (begin, end, scored) for each window, the sequence's [begin, end) sent as one
    prompt of at most `context` tokens and its last `scored` tokens scored, so that every token after the prefix is
    scored exactly once. A window's first token is only context; the last window, when fewer tokens are left than
    a window scores, starts `context` tokens before its end (a full context for its few)."""
    if context < 2:
        raise ValueError(f"a window needs at least 2 tokens, got a context of {context}")
    windows, scored = [], 0  # sequence positions 1..scored are scored so far
    while scored < n_tokens:
        end = min(scored + context, n_tokens + 1)  # the window after the last scored token, one of context first
        windows.append((max(0, end - context), end, end - 1 - scored))
        scored = end - 1
    return windows


def verify_gpt(url: str, card: dict, data_dir: Path, workers: int = 4) -> dict:
    _, text = data.load_shakespeare(data_dir)
    with httpx.Client(base_url=url) as client:
        tokenized = _post(client, "/tokenize", json={"model": "gpt", "prompt": text, "add_special_tokens": False})
        ids, context = tokenized["tokens"][: card.get("val_tokens")], tokenized["max_model_len"]
        characters = len(_post(client, "/detokenize", json={"model": "gpt", "tokens": ids})["prompt"])
        info = client.get("/tokenizer_info", params={"model": "gpt"}, timeout=300).raise_for_status().json()
        prefix = _post(client, "/tokenize", json={"model": "gpt", "prompt": info["eos_token"],
                                                  "add_special_tokens": False})["tokens"]  # lm-eval's prefix token
        sequence = prefix + ids

        def score(window: tuple[int, int, int]) -> float:
            begin, end, scored = window
            choice = _post(client, "/v1/completions", json={
                "model": "gpt", "prompt": sequence[begin:end], "echo": True, "logprobs": 1, "max_tokens": 0,
                "temperature": 0})["choices"][0]
            return sum(choice["logprobs"]["token_logprobs"][end - begin - scored:])

        with ThreadPoolExecutor(workers) as pool:
            log_likelihood = sum(pool.map(score, rolling_windows(len(ids), context)))
    served = round(-log_likelihood / characters, 4)
    trained = card["val_loss"]
    return {"metric": "nats per character, tinyshakespeare validation text (rolling log-likelihood)",
            "tokens": len(ids), "characters": characters, "context": context, "served": served, "trained": trained,
            "delta": round(served - trained, 4), "tolerance": SERVED_LOSS_TOLERANCE,
            "ok": abs(served - trained) <= SERVED_LOSS_TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.verify_served", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--url", default=None, help="a running service (default: start one on the repository)")
    parser.add_argument("--kinds", default="translation,vit,gpt", help="which checks to run (default: all)")
    parser.add_argument("--variant", default="auto",
                        help="TSERVE_VARIANT of the server it starts (default auto: what a deployment on this host "
                             "serves; `stored`: the graphs as exported, whatever this CPU is fastest with)")
    args = parser.parse_args(argv)
    repository = ModelRepository(args.repository)
    data_dir = data.resolve_data_dir(args.data_dir)
    checks = {"translation": verify_translation, "vit": verify_vit, "gpt": verify_gpt}
    wanted = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(wanted) - set(checks))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {sorted(checks)}")
    present = [kind for kind in wanted if repository.versions(kind)]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(
            ServiceProcess("verify_served", args.repository, log_level="WARNING", drain_delay_s=0,
                           variant=args.variant)).url
        results = {}
        for kind in present:
            card = json.loads((repository.get(kind).path / "metrics.json").read_text())
            results[kind] = checks[kind](url, card, data_dir)
        results["skipped"] = [kind for kind in wanted if kind not in present]
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for k, r in results.items() if k != "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
