"""Moving one file's bytes into its ``.part`` file: over HTTP(S), resumed with a ``Range`` request (a server that
ignores ``Range`` answers 200 and the download restarts from zero), or from a ``file://`` URL, resumed by seeking;
with a progress bar on a terminal (tqdm, when installed).

:func:`transfer` returns (complete, resumed) or raises :class:`Interrupted` (the .part keeps what arrived: retry)
or :class:`TransferFailed` (``transient`` says whether a retry may help).
"""

from __future__ import annotations

import http.client
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from models.fetch_verify import CHUNK

USER_AGENT = "transformer-serving-data-fetch/1 (+python-urllib)"
RANGE_NOT_SATISFIABLE = 416  # HTTP: nothing after the requested offset (a .part complete or longer than the file)
PARTIAL_CONTENT = 206  # HTTP: the requested range follows
TRANSIENT_HTTP_CODES = (408, 425, 429)  # request timeout, too early, too many requests: retried, as every 5xx is
SERVER_ERRORS = 500  # the first 5xx code


class Interrupted(Exception):
    """The transfer stopped early; the .part file keeps what arrived."""


class TransferFailed(Exception):
    """The transfer could not start or was refused; ``transient``: a retry may succeed."""

    def __init__(self, reason: str, transient: bool):
        super().__init__(reason)
        self.transient = transient


def _progress_bar(total: int | None, initial: int, label: str, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # an install without tqdm (a core requirement since service.batch): no bar
            enabled = False
        else:
            return tqdm(total=total, initial=initial, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                        leave=False, dynamic_ncols=True, file=sys.stderr)

    class _NoBar:
        def update(self, n):
            pass

        def close(self):
            pass

    return _NoBar()


def _copy(src, part: Path, mode: str, offset: int, total: int | None, label: str, progress: bool) -> int:
    """Copy src into part ("ab" to append, "wb" to restart); returns the bytes copied. Network errors while reading
    become Interrupted, with what arrived flushed to part."""
    copied = 0
    bar = _progress_bar(total, offset, label, progress)
    try:
        with open(part, mode) as out:
            while True:
                try:
                    chunk = src.read(CHUNK)
                except (http.client.IncompleteRead, OSError) as e:  # OSError: resets, timeouts
                    raise Interrupted(f"connection lost after {offset + copied:,} bytes ({e})") from e
                if not chunk:
                    break
                out.write(chunk)
                copied += len(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
    finally:
        bar.close()
    return copied


def _parse_content_range(value: str) -> tuple[int | None, int | None]:
    """'bytes START-END/TOTAL' or 'bytes */TOTAL' -> (START, TOTAL); None where absent or unparsable."""
    try:
        _unit, spec = value.strip().split(" ", 1)
        span, total = spec.split("/", 1)
        start = None if span == "*" else int(span.split("-", 1)[0])
        return start, (None if total == "*" else int(total))
    except ValueError:
        return None, None


def _transfer_http(url: str, part: Path, *, timeout: float, progress: bool, label: str, log) -> tuple[bool, bool]:
    """Download url into part, resuming from part's size with a Range request. Returns (complete, resumed):
    complete when the server's length confirmed that the whole file arrived (False: length unknown), resumed when
    earlier bytes of part were kept. Raises Interrupted or TransferFailed."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        with e:
            if e.code == RANGE_NOT_SATISFIABLE and offset:  # the .part is complete, or longer than the file
                _, total = _parse_content_range(e.headers.get("Content-Range", ""))
                if total == offset:
                    return True, True
                log(f"resume    {label}: the server refused the range; downloading again from the start")
                part.unlink()
                return _transfer_http(url, part, timeout=timeout, progress=progress, label=label, log=log)
            transient = e.code in TRANSIENT_HTTP_CODES or e.code >= SERVER_ERRORS
            raise TransferFailed(f"HTTP {e.code} {e.reason}", transient=transient)
    except urllib.error.URLError as e:
        raise TransferFailed(f"cannot connect ({e.reason})", transient=True) from e
    except (http.client.HTTPException, OSError) as e:
        raise TransferFailed(f"cannot connect ({e})", transient=True) from e
    with response:
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if offset and response.status == PARTIAL_CONTENT:
            start, total = _parse_content_range(response.headers.get("Content-Range", ""))
            if start != offset:
                log(f"resume    {label}: the server answered bytes={offset}- with Content-Range "
                    f"{response.headers.get('Content-Range')!r}; downloading again from the start")
                response.close()
                part.unlink()
                return _transfer_http(url, part, timeout=timeout, progress=progress, label=label, log=log)
            log(f"resume    {label}: continuing from byte {offset:,}")
            mode = "ab"
            if total is None and length is not None:
                total = offset + length
        else:
            if offset:
                log(f"resume    {label}: the server ignores Range requests; downloading again from the start")
            offset, mode, total = 0, "wb", length
        copied = _copy(response, part, mode, offset, total, label, progress)
    if total is not None and offset + copied < total:
        raise Interrupted(f"connection closed after {offset + copied:,} of {total:,} bytes")
    return total is not None, offset > 0


def _transfer_file(url: str, part: Path, *, progress: bool, label: str, log) -> tuple[bool, bool]:
    """file:// transfer, resumed by seeking (urllib's file handler ignores Range)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise TransferFailed(f"file URLs on another host ({parsed.netloc}) are not supported", transient=False)
    source = Path(urllib.request.url2pathname(parsed.path))
    try:
        src = open(source, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise TransferFailed(f"cannot read {source} ({e.strerror or e})", transient=False) from e
    with src:
        total = os.fstat(src.fileno()).st_size
        offset = part.stat().st_size if part.exists() else 0
        if 0 < offset <= total:
            log(f"resume    {label}: continuing from byte {offset:,}")
            src.seek(offset)
            mode = "ab"
        else:
            offset, mode = 0, "wb"
        _copy(src, part, mode, offset, total, label, progress)
    return True, offset > 0


def transfer(url: str, part: Path, **kwargs) -> tuple[bool, bool]:
    """Download ``url`` into ``part`` (see the module docstring); keyword arguments as :func:`_transfer_http`'s."""
    if urllib.parse.urlparse(url).scheme == "file":
        kwargs.pop("timeout", None)
        return _transfer_file(url, part, **kwargs)
    return _transfer_http(url, part, **kwargs)

