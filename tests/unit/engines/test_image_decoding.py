"""Image decoding under a memory budget and a deadline (`service.engines.imaging`).

Unit tests, no server: the budget's accounting (never more than its capacity reserved or decoded at once), its
first-come-first-served order, its release on errors, cancellation and deadlines, and the header checks that
refuse an image over the whole budget or a request over max_request_pixels before any pixel is decoded.

One end-to-end test against a real server process (slow): many cheap-to-send PNGs of millions of pixels, sent
concurrently with a short timeout_ms, are all 504 at their deadline, the server's peak RSS stays within the budget
plus a stated slack, and the server classifies a normal image right after.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from PIL import Image

from service.engines import imaging
from service.engines.imaging import DecodeBudget, ImageDecoder, decode_cost
from service.errors import BadInput, DeadlineExceeded, PayloadTooLarge
from service.settings import Settings

# unit tests: the 504 comes within this of the deadline (no server, no network: a busy machine's scheduling); below
# the 0.3 s a decode in progress runs on, so that answering after it still fails
DEADLINE_MARGIN_S = 0.25


@dataclass
class Encoded:
    name: str
    data: bytes | str


class FakeEngine:
    """Preprocessing that only reads the image: an (1, 2, 2) array filled with its width."""

    channels = 1

    def preprocess(self, image: Image.Image) -> np.ndarray:
        return np.full((1, 2, 2), image.size[0], dtype=np.float32)


def png(width: int, height: int, mode: str = "RGBA") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), 7 if mode == "L" else (200, 30, 40, 128)[:len(mode)]).save(buffer, "PNG")
    return buffer.getvalue()


RGBA_100 = png(100, 100)  # 100 x 100 x 17 bytes while decoded and preprocessed for an "L" model (one strip)
RGBA_100_COST = decode_cost("RGBA", 100, 100, True, 1)
L_50 = png(50, 50, "L")


class Recorder:
    """Stands in for `imaging.decode_and_preprocess` (and calls it): records which images were started and the
    most bytes (as reserved) being decoded at once; each decode waits for `gate` (if any), then `hold_s`."""

    def __init__(self, hold_s: float = 0.0, gate: threading.Event | None = None):
        self.hold_s, self.gate = hold_s, gate
        self.started: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._decode = imaging.decode_and_preprocess

    def __call__(self, header, engine):
        with self._lock:
            self.started.append(header.name)
            self.in_flight += header.cost
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            time.sleep(self.hold_s)
            return self._decode(header, engine)
        finally:
            with self._lock:
                self.in_flight -= header.cost


@pytest.fixture
def recorder(monkeypatch):
    def install(**kwargs) -> Recorder:
        recorder = Recorder(**kwargs)
        monkeypatch.setattr(imaging, "decode_and_preprocess", recorder)
        return recorder
    return install


@pytest.fixture
def make_decoder():
    decoders = []

    def make(**knobs) -> ImageDecoder:
        decoders.append(ImageDecoder(Settings(**{"image_decode_threads": 2, **knobs})))
        return decoders[-1]
    yield make
    for decoder in decoders:
        decoder.close()


def settle(budget: DecodeBudget, timeout: float = 5.0) -> None:
    """Wait until every reservation is given back (decoder threads release when they finish)."""
    deadline = time.monotonic() + timeout
    while budget.reserved and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget.reserved == 0 and budget.waiting == 0


def images(*data: bytes) -> list[Encoded]:
    return [Encoded(f"images[{i}]", d) for i, d in enumerate(data)]


# --- cost estimates -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, transparent, channels, per_pixel", [
    ("L", False, 1, 1 + 1),  # decoded + convert("L") (a copy)
    ("1", False, 1, 1 + 1),
    ("P", False, 1, 1 + 1),
    ("P", True, 1, 1 + 1 + 12),  # + one strip's RGBA copy, white background and composite (20 rows < a strip)
    ("I;16", False, 1, 2 + 1),
    ("RGB", False, 1, 4 + 1),  # Pillow stores RGB in 4 bytes per pixel
    ("RGB", False, 3, 4 + 4),
    ("RGBA", True, 1, 4 + 1 + 12),
    ("LA", True, 3, 4 + 4 + 12),
    ("CMYK", False, 1, 4 + 1),
    ("F", False, 1, 4 + 1),
])
def test_decode_cost_counts_storage_and_preprocessing_copies(mode, transparent, channels, per_pixel):
    assert decode_cost(mode, 30, 20, transparent, channels) == 600 * per_pixel


def test_a_large_transparent_image_costs_one_strip_of_compositing_copies():
    from service.engines.vit import COMPOSITE_STRIP_ROWS

    assert decode_cost("RGBA", 4000, 4000, True, 1) == 4000 * 4000 * (4 + 1) + 12 * 4000 * COMPOSITE_STRIP_ROWS


def test_pool_has_one_thread_per_core_by_default(make_decoder):
    assert make_decoder(image_decode_threads=0).threads == os.cpu_count()
    assert make_decoder(image_decode_threads=3).threads == 3


# --- the budget ---------------------------------------------------------------------------------------------

def test_concurrent_decodes_never_hold_more_than_the_budget(make_decoder, recorder):
    capacity = 3 * RGBA_100_COST + RGBA_100_COST // 2  # room for 3 of the large images at once, not 4
    decoder = make_decoder(image_decode_threads=6, image_decode_budget_bytes=capacity)
    record = recorder(hold_s=0.02)
    requests = [images(*([RGBA_100, L_50] * 3)) for _ in range(6)]

    async def scenario():
        deadline = time.monotonic() + 30
        return await asyncio.gather(*(decoder.decode(r, FakeEngine(), deadline) for r in requests))

    results = asyncio.run(scenario())
    assert [r.shape for r in results] == [(6, 1, 2, 2)] * 6
    assert [float(r[0, 0, 0, 0]) for r in results] == [100.0] * 6 and float(results[0][1, 0, 0, 0]) == 50.0
    assert len(record.started) == 36
    assert RGBA_100_COST < record.max_in_flight <= capacity  # decodes overlapped, within the budget
    assert decoder.budget.peak <= capacity
    settle(decoder.budget)


def test_budget_is_first_come_first_served():
    async def scenario():
        budget = DecodeBudget(10)
        await budget.reserve(6)
        granted = []

        async def take(tag, nbytes):
            await budget.reserve(nbytes)
            granted.append(tag)

        tasks = [asyncio.create_task(take("big", 8))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(take(f"small{i}", 1)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert granted == [] and budget.waiting == 6  # 4 bytes are free, but no small one overtakes "big"
        budget.release(6)
        await asyncio.sleep(0.05)
        assert granted == ["big", "small0", "small1"] and budget.reserved == 10
        budget.release(8)
        await asyncio.gather(*tasks)
        assert granted == ["big"] + [f"small{i}" for i in range(5)] and budget.reserved == 5
        assert budget.peak == 10

    asyncio.run(scenario())


def test_budget_can_be_released_from_another_thread():
    async def scenario():
        budget = DecodeBudget(10)
        await budget.reserve(10)
        threading.Timer(0.05, budget.release, args=(10,)).start()
        await asyncio.wait_for(budget.reserve(7), timeout=5)
        assert budget.reserved == 7

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind_it():
    async def scenario():
        budget = DecodeBudget(10)
        await budget.reserve(5)
        big = asyncio.create_task(budget.reserve(8))
        await asyncio.sleep(0)
        small = asyncio.create_task(budget.reserve(3))
        await asyncio.sleep(0.01)
        assert not small.done()
        big.cancel()
        await asyncio.wait_for(small, timeout=5)
        assert budget.reserved == 8 and budget.waiting == 0

    asyncio.run(scenario())


def test_budget_is_released_when_an_image_fails(make_decoder, recorder):
    decoder = make_decoder(image_decode_budget_bytes=2 * RGBA_100_COST)
    record = recorder()
    truncated = RGBA_100[: len(RGBA_100) // 2]

    async def scenario():
        return await decoder.decode(images(RGBA_100, truncated, RGBA_100, RGBA_100), FakeEngine(),
                                    time.monotonic() + 30)

    with pytest.raises(BadInput, match=r"images\[1\] could not be decoded"):
        asyncio.run(scenario())
    assert "images[1]" in record.started
    settle(decoder.budget)


def test_cancelled_request_starts_nothing_more_and_releases_its_bytes(make_decoder, recorder):
    decoder = make_decoder(image_decode_threads=1)
    gate = threading.Event()
    record = recorder(gate=gate)

    async def scenario():
        task = asyncio.create_task(decoder.decode(images(*[RGBA_100] * 5), FakeEngine(), time.monotonic() + 30))
        while not record.started:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the other four are reserved and queued on the pool by now
        task.cancel()  # as when the handler is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    gate.set()  # the image being decoded finishes in its thread and gives its bytes back
    settle(decoder.budget)
    assert record.started == ["images[0]"]


def test_deadline_while_waiting_for_room_is_a_prompt_504(make_decoder, recorder):
    decoder = make_decoder(image_decode_budget_bytes=RGBA_100_COST)
    record = recorder()

    async def scenario():
        await decoder.budget.reserve(RGBA_100_COST)  # another request holds the whole budget
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await decoder.decode(images(RGBA_100), FakeEngine(), start + 0.2)
        return time.monotonic() - start

    elapsed = asyncio.run(scenario())
    assert 0.2 <= elapsed < 0.2 + DEADLINE_MARGIN_S
    assert decoder.budget.waiting == 0 and decoder.budget.reserved == RGBA_100_COST  # only the holder's bytes
    assert record.started == []


def test_deadline_while_decoding_is_a_prompt_504_and_nothing_more_starts(make_decoder, recorder):
    decoder = make_decoder(image_decode_threads=1)
    record = recorder(hold_s=0.5)

    async def scenario():
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await decoder.decode(images(*[RGBA_100] * 4), FakeEngine(), start + 0.2)
        return time.monotonic() - start

    elapsed = asyncio.run(scenario())
    assert 0.2 <= elapsed < 0.2 + DEADLINE_MARGIN_S  # the decode in progress runs on for 0.3 s
    settle(decoder.budget)
    assert record.started == ["images[0]"]


def test_past_deadline_decodes_nothing(make_decoder, recorder):
    decoder = make_decoder()
    record = recorder()
    with pytest.raises(DeadlineExceeded):
        asyncio.run(decoder.decode(images(RGBA_100), FakeEngine(), time.monotonic() - 0.001))
    assert record.started == []


# --- header checks ------------------------------------------------------------------------------------------

def test_image_over_the_whole_budget_is_413_naming_it_and_the_setting(make_decoder, recorder):
    decoder = make_decoder(image_decode_budget_bytes=RGBA_100_COST - 1)
    record = recorder()
    with pytest.raises(PayloadTooLarge) as error:
        asyncio.run(decoder.decode(images(L_50, RGBA_100), FakeEngine(), time.monotonic() + 30))
    assert "images[1]" in error.value.message and "TSERVE_IMAGE_DECODE_BUDGET_BYTES" in error.value.message
    assert str(RGBA_100_COST) in error.value.message
    assert record.started == []
    settle(decoder.budget)


def test_request_over_max_request_pixels_is_413_before_any_decode(make_decoder, recorder):
    decoder = make_decoder(max_request_pixels=3 * 100 * 100)
    record = recorder()
    assert asyncio.run(decoder.decode(images(*[RGBA_100] * 3), FakeEngine(), time.monotonic() + 30)).shape[0] == 3
    record.started.clear()
    with pytest.raises(PayloadTooLarge) as error:
        asyncio.run(decoder.decode(images(*[RGBA_100] * 3, L_50), FakeEngine(), time.monotonic() + 30))
    message = error.value.message
    assert "32500" in message and "30000" in message and "TSERVE_MAX_REQUEST_PIXELS" in message
    assert record.started == []


def test_header_errors_name_the_image(make_decoder, recorder):
    decoder = make_decoder(max_image_pixels=50 * 50)
    record = recorder()

    def error(*data) -> str:
        with pytest.raises((BadInput, PayloadTooLarge)) as caught:
            asyncio.run(decoder.decode(images(*data), FakeEngine(), time.monotonic() + 30))
        return caught.value.message

    assert "images[1] is not valid base64" in error(L_50, "***")
    assert "images[0] is empty" in error(b"")
    assert "images[1] is not an image format" in error(L_50, b"GIF89a nope")
    assert "images[0] is 100x100 = 10000 pixels" in error(RGBA_100)
    assert record.started == []
    data_url = "data:image/png;base64," + base64.b64encode(L_50).decode()
    assert asyncio.run(decoder.decode(images(data_url), FakeEngine(), time.monotonic() + 30)).shape == (1, 1, 2, 2)


# --- end to end: the attack against a real server -----------------------------------------------------------

ATTACK_SIZE = 4000  # 16 M pixels, RGBA: 92 MB each while decoded and preprocessed, so two fit the default budget
ATTACK_IMAGES = 4  # per request: 64 M pixels, the default max_request_pixels (the 16 per request: a 413)
ATTACK_REQUESTS = 6  # 24 decodes of ~0.3 s on 2 cores: far more than fits before the deadline
ATTACK_TIMEOUT_MS = 1000
# How late after its deadline the server answers a 504 (its own access-log latency): ~0.1 s on an idle 2-core
# machine; a server that waited for the decodes would answer after the ~3.6 s they take (more on a busy machine).
ATTACK_MARGIN_S = 1.0
# After the last 504 only the decodes running at the deadline may finish (one per decoder thread, the budget holds
# two): the server's CPU seconds from then until it is idle, in units of one decode's CPU seconds measured here
# (CPU seconds, not wall time: a busy machine slows both alike). A server that kept decoding spends ~18 of them.
DECODES_AFTER_DEADLINE = 2 * 3  # two in flight, x3 for the server's decode + preprocess costing more than ours
IDLE_WINDOW_S, IDLE_CPU_S, IDLE_TIMEOUT_S = 0.5, 0.05, 60.0
# peak RSS over the RSS before the attack: the budget, plus what glibc keeps of freed blocks in the decoder
# threads' arenas and the requests' bodies
RSS_SLACK_BYTES = 96 * 2**20


def _proc_status(pid: int, key: str) -> int:
    """A `/proc/<pid>/status` memory line (VmRSS, VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow
def test_decompression_attack_is_504_at_the_deadline_with_bounded_memory(tiny_repository, tmp_path):
    from tests.support.server import ServerProcess
    from tests.support.waiting import poll

    server = ServerProcess("decode attack", tiny_repository, tmp_path, models='["vit"]', drain_delay_s=0).start()
    try:
        pid = server.proc.pid
        normal = png(28, 28, "L")
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post("/v1/classify", files=[("files", ("warm.png", normal))]).status_code == 200
        rss_before = _proc_status(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS, so that the peak is the attack's
        big = png(ATTACK_SIZE, ATTACK_SIZE)  # ~37 KB of one colour
        files = [("files", (f"big{i}.png", big, "image/png")) for i in range(ATTACK_IMAGES)]
        with httpx.Client(base_url=server.url, timeout=30) as client:  # the 16 per request: refused at once
            too_many = client.post("/v1/classify", files=files * 4, data={"timeout_ms": "1000"})
            assert too_many.status_code == 413 and "TSERVE_MAX_REQUEST_PIXELS" in too_many.text, too_many.text

        started = time.process_time()  # one decode's CPU seconds on this machine, now: the unit of the check below
        Image.open(io.BytesIO(big)).convert("L").resize((28, 28))
        decode_cpu_s = time.process_time() - started

        def attack(i):
            with httpx.Client(base_url=server.url, timeout=30, headers={"x-request-id": f"attack-{i}"}) as client:
                return client.post("/v1/classify", files=files, data={"timeout_ms": str(ATTACK_TIMEOUT_MS)})

        with ThreadPoolExecutor(ATTACK_REQUESTS) as pool:
            results = list(pool.map(attack, range(ATTACK_REQUESTS)))
        cpu_at_last_response = _cpu_seconds(pid)
        peak = _proc_status(pid, "VmHWM")
        statuses = [r.status_code for r in results]
        assert set(statuses) <= {200, 504} and statuses.count(504) >= ATTACK_REQUESTS - 1, [r.text for r in results]
        assert all(r.json()["error"]["type"] == "timeout" for r in results if r.status_code == 504)
        poll(lambda: len(server.access_records()) >= ATTACK_REQUESTS + 2, timeout=10, message="the access log")
        latencies = sorted(record["latency_ms"] / 1000 for record in server.access_records()
                           if record["request_id"].startswith("attack-"))
        print(f"server latencies (s): {latencies}; RSS before {rss_before / 2**20:.0f} MiB, "
              f"peak {peak / 2**20:.0f} MiB; one decode {decode_cpu_s:.2f} CPU s")
        assert len(latencies) == ATTACK_REQUESTS and latencies[-1] <= ATTACK_TIMEOUT_MS / 1000 + ATTACK_MARGIN_S, \
            latencies
        budget = Settings.model_fields["image_decode_budget_bytes"].default  # the server runs with it
        assert peak - rss_before <= budget + RSS_SLACK_BYTES, (peak, rss_before)

        def idle() -> float | None:  # the server's CPU seconds once a window passes without work, else None
            cpu = _cpu_seconds(pid)
            time.sleep(IDLE_WINDOW_S)
            now = _cpu_seconds(pid)
            return now if now - cpu < IDLE_CPU_S else None

        after = poll(idle, timeout=IDLE_TIMEOUT_S, message="the server idle after the attack") - cpu_at_last_response
        assert after <= DECODES_AFTER_DEADLINE * decode_cpu_s + IDLE_CPU_S, \
            f"the server kept decoding after every request had expired: {after:.2f} CPU s, one decode " \
            f"{decode_cpu_s:.2f}"
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/health/ready").status_code == 200
            response = client.post("/v1/classify", files=[("files", ("normal.png", normal))])
            assert response.status_code == 200 and len(response.json()["predictions"]) == 1
    finally:
        server.stop()
