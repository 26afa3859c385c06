"""The image decompression attack on `POST /v1/classify`, measured: N concurrent requests of M flat RGBA PNGs of
SIZE x SIZE pixels (a few tens of KB each on the wire, 64 MB each once decoded), against `python -m service`
serving the ViT of a model repository with default settings (plus any KEY=VALUE given).

Prints one JSON object: the statuses, client-side latencies, the server's RSS before the attack, its peak during it
(VmHWM, reset just before) and 2 s after, the CPU seconds the server used in those 2 s (decoding must stop at the
deadline), and whether a normal image is classified afterwards. docs/operations.md's figures come from:

    .venv/bin/python bench/decode_attack.py --size 4000 --requests 6 --images 16 --timeout-ms 2000
    .venv/bin/python bench/decode_attack.py --size 4000 --requests 6 --images 4 --timeout-ms 2000
    .venv/bin/python bench/decode_attack.py --size 4000 --requests 1 --images 64 --timeout-ms 1000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from PIL import Image

from service.client.launcher import ServiceProcess

PROJECT_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120
AFTER_S = 2.0  # how long after the attack the server's CPU and RSS are watched


def proc_mib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith(key + ":"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", default=str(PROJECT_ROOT / "model_repository"))
    parser.add_argument("--size", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--timeout-ms", type=int, default=2000)
    parser.add_argument("settings", nargs="*", help="extra server settings, KEY=VALUE (e.g. TSERVE_MAX_IMAGES=8)")
    args = parser.parse_args()

    extra = dict(kv.split("=", 1) for kv in args.settings)  # over the defaults below, as given
    with ServiceProcess("decode attack server", args.repository, env=extra, ready_timeout=READY_TIMEOUT_S,
                        models='["vit"]', drain_delay_s=0, log_level="WARNING") as server:
        url = server.url
        normal = png(Image.new("L", (28, 28), 9))
        assert httpx.post(url + "/v1/classify", files=[("files", ("n.png", normal))], timeout=30).status_code == 200
        before = proc_mib(server.pid, "VmRSS")
        with open(f"/proc/{server.pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS: the peak is the attack's
        big = png(Image.new("RGBA", (args.size, args.size), (200, 30, 40, 128)))
        files = [("files", (f"big{i}.png", big, "image/png")) for i in range(args.images)]

        def attack(_):
            started = time.monotonic()
            response = httpx.post(url + "/v1/classify", files=files, data={"timeout_ms": str(args.timeout_ms)},
                                  timeout=300)
            error = response.json().get("error", {}).get("message", "")[:200]
            return response.status_code, round(time.monotonic() - started, 3), error

        with ThreadPoolExecutor(args.requests) as pool:
            results = list(pool.map(attack, range(args.requests)))
        peak = proc_mib(server.pid, "VmHWM")
        cpu = cpu_seconds(server.pid)
        time.sleep(AFTER_S)
        cpu_after = cpu_seconds(server.pid) - cpu
        after = proc_mib(server.pid, "VmRSS")
        normal_status = httpx.post(url + "/v1/classify", files=[("files", ("n.png", normal))],
                                   timeout=30).status_code
        print(json.dumps({
            "attack": f"{args.requests} x {args.images} RGBA PNGs of {args.size}x{args.size} ({len(big)} bytes "
                      f"each), timeout_ms {args.timeout_ms}",
            "statuses": sorted(status for status, _, _ in results),
            "client_latency_s": sorted(latency for _, latency, _ in results),
            "first_error": results[0][2], "rss_before_mib": before, "rss_peak_mib": peak,
            f"rss_{AFTER_S:g}s_after_mib": after, f"server_cpu_s_in_{AFTER_S:g}s_after": round(cpu_after, 2),
            "normal_image_after": normal_status}))


if __name__ == "__main__":
    main()
