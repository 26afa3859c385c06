"""Image decoding for `POST /v1/classify`: encoded files -> header checks -> pixels -> the engine's preprocessing,
on a bounded pool of decoder threads, under one memory budget shared by every request, within each request's
deadline.

A file's size says nothing about its pixels (a 4000x4000 RGBA PNG of one colour: 70 KB on the wire, 64 MB decoded),
so everything that can be known without decoding is checked first, from the headers: `decode_cost` (the bytes an
image holds until the end of `engine.preprocess`), `DecodeBudget` (those bytes, reserved first come, first served),
`ImageDecoder` (the pool, `TSERVE_IMAGE_DECODE_THREADS`, and the budget, `TSERVE_IMAGE_DECODE_BUDGET_BYTES`).
Invariant: pixels are decoded only within the budget, only before the deadline and only while someone waits; an
image not yet started is never started after the deadline or once the request is abandoned.
Bad input is a `ServiceError` that names the image: 400 for what cannot be decoded, 413 for what is too large.

Design notes: docs/architecture.md, service/engines/imaging.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

from service.engines.vit import COMPOSITE_STRIP_ROWS, has_transparency
from service.errors import BadInput, DeadlineExceeded, PayloadTooLarge, Unavailable
from service.settings import Settings

# Bytes per pixel of Pillow's storage, by mode: "1", "L" and "P" one byte, "I;16*" two, every other mode four
# (Pillow stores multi-band images, RGB included, and 32-bit single-band ones, I and F, in 4 bytes per pixel).
ONE_BYTE_MODES = frozenset({"1", "L", "P"})
TWO_BYTE_MODE_PREFIX = "I;16"
TWO_PIXEL_BYTES = 2
WIDE_PIXEL_BYTES = 4
# base64 writes every 3 bytes (a group, the last one padded) as 4 characters.
BASE64_GROUP_BYTES, BASE64_GROUP_CHARS = 3, 4
# What `ViTEngine.preprocess` holds besides the decoded image, all alive at once: the image in the model's mode
# ("L": 1 byte per pixel, "RGB": 4; a copy even when the mode is already right) and, for an image with
# transparency, the RGBA copies of one strip of rows that is being composited on white (`engine.on_white`: the
# strip converted to RGBA, the white background, the composite). The model-sized results (resized, float32) are a
# few hundred KB at most and not counted. So a 4000x4000 RGBA image for an "L" model holds 16M x (4 + 1) bytes +
# 3 x 4 x 4000 x 256 = 92 MB at its peak, an RGB photo 5 bytes per pixel, a grey one 2.
COMPOSITE_COPIES = 3


@dataclass(frozen=True)
class EncodedImage:
    """An image as a request sent it: file bytes, or base64 text (decoded on the pool, not the event loop)."""

    name: str  # how error messages refer to it: "images[2]", "files[0] ('shoe.png')", "IMAGE[1]"
    data: bytes | str


class ImageEngine(Protocol):
    channels: int  # 1: the model's mode is "L", else "RGB"

    def preprocess(self, image: Image.Image) -> np.ndarray: ...  # (C, H, W)


@dataclass(frozen=True)
class ImageHeader:
    """An image whose header passed the limits: its file bytes and what decoding it will cost."""

    name: str
    data: bytes
    width: int
    height: int
    mode: str
    cost: int  # bytes, as decode_cost says


def storage_bytes_per_pixel(mode: str) -> int:
    if mode in ONE_BYTE_MODES:
        return 1
    return TWO_PIXEL_BYTES if mode.startswith(TWO_BYTE_MODE_PREFIX) else WIDE_PIXEL_BYTES


def decode_cost(mode: str, width: int, height: int, transparent: bool, model_channels: int) -> int:
    """Bytes held at once while an image of this header is decoded and preprocessed (see the constants above)."""
    per_pixel = storage_bytes_per_pixel(mode) + (1 if model_channels == 1 else WIDE_PIXEL_BYTES)
    strips = COMPOSITE_COPIES * WIDE_PIXEL_BYTES * width * min(height, COMPOSITE_STRIP_ROWS) if transparent else 0
    return width * height * per_pixel + strips


# --- the budget ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    loop: asyncio.AbstractEventLoop
    woken: asyncio.Future
    granted: bool = False  # set under the budget's lock: from then on the bytes are the waiter's


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():  # not cancelled meanwhile
        woken.set_result(None)


class DecodeBudget:
    """`capacity` bytes, reserved by `await reserve(n)` (in arrival order: nobody overtakes a waiter, so a large
    reservation is granted as soon as the ones before it are released) and given back by `release(n)`, which
    any thread may call. A reservation cancelled while it waits (deadline, client gone) leaves the queue."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.reserved = 0
        self.peak = 0  # the most ever reserved at once: for tests and for debugging
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def reserve(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes can never fit a budget of {self.capacity}")
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self.reserved + nbytes <= self.capacity:
                self._take(nbytes)
                return
            waiter = _Waiter(nbytes, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter.woken
        except BaseException:  # cancelled: leave the queue, or give back what was granted meanwhile
            with self._lock:
                if waiter.granted:
                    self.reserved -= nbytes
                else:
                    self._waiters.remove(waiter)
                self._grant()  # whoever queued behind this waiter may fit now
            raise

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= nbytes
            self._grant()

    def _take(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)

    def _grant(self) -> None:
        """With the lock held: grant the waiters at the head of the queue while they fit."""
        while self._waiters and self.reserved + self._waiters[0].nbytes <= self.capacity:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._take(waiter.nbytes)
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.woken)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                self.reserved -= waiter.nbytes


# --- the decoder --------------------------------------------------------------------------------------------


class ImageDecoder:
    """The decoder threads and the budget, shared by all requests (one per app, on `app.state.image_decoder`)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.threads = settings.image_decode_threads or os.cpu_count() or 1
        self.budget = DecodeBudget(settings.image_decode_budget_bytes)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="image-decode")

    def close(self) -> None:
        """Drop the decodes not yet started and wait for the running ones (at shutdown)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def decode(self, images: Sequence[EncodedImage], engine: ImageEngine, deadline: float) -> np.ndarray:
        """The preprocessed images (n, C, H, W), or a ServiceError: DeadlineExceeded at `deadline` (a
        `time.monotonic()` value), 400 / 413 naming the image, 413 for a request over max_request_pixels."""
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("the request's deadline expired before its images were decoded")
        abandoned = threading.Event()  # set when this call returns or raises: start nothing more for it
        decodes: list[Future] = []
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                headers = await asyncio.wrap_future(
                    self._submit(0, abandoned, deadline, self._read_headers, images, engine))
                for header in headers:
                    if any(f.done() and not f.cancelled() and f.exception() for f in decodes):
                        break  # an image failed: that is the answer, start no more
                    await self.budget.reserve(header.cost)
                    decodes.append(self._submit(header.cost, abandoned, deadline, decode_and_preprocess, header,
                                                engine))
                pixels = [await asyncio.wrap_future(f) for f in decodes]  # the first error in request order
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline expired while its images were being decoded") from None
        finally:
            abandoned.set()
            for future in decodes:
                future.cancel()  # those not started; the running ones finish and give their bytes back then
        return np.stack(pixels)  # (n, C, H, W)

    def _submit(self, nbytes: int, abandoned: threading.Event, deadline: float, fn: Callable, *args) -> Future:
        """Run fn(*args) on the pool unless the request is abandoned or past its deadline by the time a thread
        takes it up; `nbytes` (already reserved) go back to the budget when it is done or dropped."""
        try:
            future = self._pool.submit(_unless_abandoned, abandoned, deadline, fn, *args)
        except RuntimeError:  # the pool is shut down
            self.budget.release(nbytes)
            raise Unavailable("the server is shutting down") from None
        if nbytes:
            future.add_done_callback(lambda _: self.budget.release(nbytes))
        return future

    def _read_headers(self, images: Sequence[EncodedImage], engine: ImageEngine) -> list[ImageHeader]:
        """(A decoder thread) every image's bytes and header, checked against the limits; no pixel decoded."""
        headers = [read_header(image, engine, self.settings, self.budget.capacity) for image in images]
        pixels = sum(h.width * h.height for h in headers)
        if pixels > self.settings.max_request_pixels:
            raise PayloadTooLarge(f"the request's {len(headers)} images have {pixels} pixels in all; the limit is "
                                  f"{self.settings.max_request_pixels} (TSERVE_MAX_REQUEST_PIXELS)")
        return headers


def _unless_abandoned(abandoned: threading.Event, deadline: float, fn: Callable, *args):
    if abandoned.is_set() or time.monotonic() >= deadline:
        raise DeadlineExceeded("the request's deadline expired before its images were decoded")
    return fn(*args)


# --- one image (a decoder thread) ---------------------------------------------------------------------------


def read_header(image: EncodedImage, engine: ImageEngine, settings: Settings, budget_bytes: int) -> ImageHeader:
    """The image's bytes and header, or 400 / 413 naming it; no pixel is decoded."""
    data = b64decode(image, settings) if isinstance(image.data, str) else image.data
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(f"{image.name} has {len(data)} bytes; the limit is {settings.max_image_bytes}")
    if not data:
        raise BadInput(f"{image.name} is empty")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height, mode, transparent = *opened.size, opened.mode, has_transparency(opened)
    except Image.DecompressionBombError as error:
        raise PayloadTooLarge(f"{image.name}: {error}") from None
    except UnidentifiedImageError:
        raise BadInput(f"{image.name} is not an image format Pillow can read") from None
    except Exception as error:  # a header that Pillow recognises but cannot parse
        raise BadInput(f"{image.name} could not be decoded: {error}") from None
    if width * height > settings.max_image_pixels:
        raise PayloadTooLarge(f"{image.name} is {width}x{height} = {width * height} pixels; the limit is "
                              f"{settings.max_image_pixels}")
    cost = decode_cost(mode, width, height, transparent, engine.channels)
    if cost > budget_bytes:
        raise PayloadTooLarge(f"{image.name} is {width}x{height} {mode}: decoding and preprocessing it takes "
                              f"{cost} bytes, more than the whole image decoding budget of {budget_bytes} "
                              f"(TSERVE_IMAGE_DECODE_BUDGET_BYTES)")
    return ImageHeader(image.name, data, width, height, mode, cost)


def decode_and_preprocess(header: ImageHeader, engine: ImageEngine) -> np.ndarray:
    """Decode the pixels and run the engine's preprocessing: (C, H, W), or 400 naming the image."""
    try:
        with Image.open(io.BytesIO(header.data)) as decoded:
            decoded.load()
            return engine.preprocess(decoded)
    except Exception as error:  # truncated or corrupt files, modes that cannot be converted
        # the error's frames hold the engine's intermediate images: free them now, not when the error is dropped
        traceback.clear_frames(error.__traceback__)
        raise BadInput(f"{header.name} could not be decoded: {error}") from None


def b64decode(image: EncodedImage, settings: Settings) -> bytes:
    text = image.data
    if text.startswith("data:"):  # a data URL: data:image/png;base64,....
        text = text.partition(",")[2]
    text = "".join(text.split())  # line-wrapped base64 (as `base64` prints it) is fine
    groups = -(-settings.max_image_bytes // BASE64_GROUP_BYTES)  # the base64 of the largest image allowed
    if len(text) > groups * BASE64_GROUP_CHARS:
        raise PayloadTooLarge(f"{image.name} has more than {settings.max_image_bytes} bytes, the limit")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput(f"{image.name} is not valid base64") from None
