"""Download the three datasets into the layout :mod:`models.data` reads, verified against committed checksums.

    make data                                     # = python -m models.data fetch
    python -m models.data fetch [--data-dir DIR] [--mirror BASE_URL] [--only NAME ...] [--quiet]
    python -m models.fetch checksums REFERENCE_DIR [--write]   # regenerate models/data_checksums.py

- Where: ``--data-dir``, else ``$TSERVE_DATA_DIR``, else ``./data`` (created if missing).
- From: the upstream GitHub repositories (``raw.githubusercontent.com``, see :data:`FILES`), or a mirror
  (``--mirror`` / ``$TSERVE_DATA_MIRROR``): a base URL (``https://``, ``http://``, ``file://`` or a local folder)
  under which the data folder's own relative paths are found, e.g. ``BASE/multi30k/train.de.gz``, in the same
  form as the data folder (a copy of a complete data folder is a valid mirror).
- Verified: the SHA-256 of every file's *decompressed* content must match :mod:`models.data_checksums`
  (recompressed copies, e.g. Debian's Fashion-MNIST, have other compressed bytes but the same content).
- Resumable: bytes go to ``<name>.part``; a rerun continues it with an HTTP ``Range`` request (a server that
  ignores ``Range`` answers 200 and the download restarts from zero; ``file://`` resumes by seeking).
- Atomic: a file appears under its final name only once verified (``os.replace`` in the same folder).
- Idempotent: a present file whose content verifies is left alone; a present file that does not verify is an
  error (never overwritten: delete it and rerun).
- Exit status 0 when every requested file is present and verified, 1 otherwise.

Upstream compression vs the loaders' names: every current upstream file is already stored in the form the loaders
read (Multi30k and Fashion-MNIST gzip, tinyshakespeare plain text); :class:`DataFile` records both forms and the
fetcher gzips or gunzips explicitly if they ever differ.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from models.data import ENV_VAR, MULTI30K_SPLITS, DataError

MIRROR_ENV_VAR = "TSERVE_DATA_MIRROR"
DATASETS = ("multi30k", "tinyshakespeare", "fashion-mnist")
CHUNK = 1 << 16
USER_AGENT = "transformer-serving-data-fetch/1 (+python-urllib)"
CHECKSUMS_MODULE = Path(__file__).with_name("data_checksums.py")
_FETCH_COMMAND = "python -m models.data fetch"


@dataclass(frozen=True)
class DataFile:
    """One file: where the loaders read it (``path``, relative to the data folder; also its path on a mirror) and
    where it comes from upstream (``url``, gzip-compressed there or not)."""

    dataset: str
    path: str
    url: str
    upstream_gzip: bool

    @property
    def gzip(self) -> bool:
        """Whether the data folder (and a mirror) holds it gzip-compressed: the loaders' names say so."""
        return self.path.endswith(".gz")


_MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
_FASHION_URL = "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"

FILES: tuple[DataFile, ...] = (
    *(
        DataFile("multi30k", f"multi30k/{split}.{lang}.gz", f"{_MULTI30K_URL}{split}.{lang}.gz", upstream_gzip=True)
        for split in MULTI30K_SPLITS
        for lang in ("de", "en")
    ),
    DataFile("tinyshakespeare", "tinyshakespeare/input.txt", _SHAKESPEARE_URL, upstream_gzip=False),
    *(
        DataFile("fashion-mnist", f"fashion-mnist/{prefix}-{kind}-ubyte.gz", f"{_FASHION_URL}{prefix}-{kind}-ubyte.gz",
                 upstream_gzip=True)
        for prefix in ("train", "t10k")
        for kind in ("images-idx3", "labels-idx1")
    ),
)


def _committed_checksums() -> Mapping[str, Mapping[str, object]]:
    from models.data_checksums import CHECKSUMS

    return CHECKSUMS


class FetchError(Exception):
    """A file could not be fetched or verified; the message names the file, the URL and what to do."""


@dataclass
class FetchResult:
    data_dir: Path
    present: list[str] = field(default_factory=list)  # already there and verified
    downloaded: list[str] = field(default_factory=list)  # downloaded and verified now
    failed: dict[str, str] = field(default_factory=dict)  # path -> error message

    @property
    def ok(self) -> bool:
        return not self.failed


# --- content digests ---------------------------------------------------------------------------------------------


def content_digest(path: str | os.PathLike, gzipped: bool) -> tuple[str, int]:
    """(SHA-256 hex, size) of the file's content, decompressed first when ``gzipped``.

    Raises EOFError for a cut-off gzip stream, OSError (gzip.BadGzipFile) or zlib.error for other damage."""
    digest, size = hashlib.sha256(), 0
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def compute_checksums(reference_dir: str | os.PathLike, files: Iterable[DataFile] = FILES) -> dict[str, dict]:
    """Checksum table ({path: {"sha256", "size"}} of decompressed content) of a complete reference data folder."""
    root = Path(reference_dir)
    table = {}
    for f in files:
        path = root / f.path
        if not path.is_file():
            raise DataError(f"file not found: {path}; the reference folder must hold every file of the layout")
        try:
            sha256, size = content_digest(path, f.gzip)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"cannot read {path} ({e})") from e
        table[f.path] = {"sha256": sha256, "size": size}
    return table


def render_checksums_module(table: Mapping[str, Mapping[str, object]]) -> str:
    lines = [
        '"""SHA-256 and size of the DECOMPRESSED content of every data file (models/fetch.py verifies downloads',
        "against it). Generated from the reference copies by",
        "",
        "    python -m models.fetch checksums /work/shared/data --write",
        "",
        'Do not edit by hand: regenerate it from a verified data folder."""',
        "",
        "CHECKSUMS: dict[str, dict[str, object]] = {",
    ]
    for path, entry in table.items():
        lines.append(f'    "{path}":\n        {{"sha256": "{entry["sha256"]}", "size": {entry["size"]}}},')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _check_content(path: Path, gzipped: bool, expected: Mapping[str, object]) -> tuple[str, str]:
    """("ok" | "short" | "bad", detail). "short": a cut-off gzip stream, or a plain file shorter than expected."""
    try:
        sha256, size = content_digest(path, gzipped)
    except EOFError as e:
        return "short", f"the gzip stream is cut off ({e})"
    except (OSError, zlib.error) as e:
        return "bad", f"not a valid gzip file ({e})" if gzipped else f"cannot be read ({e})"
    if sha256 == expected["sha256"] and size == expected["size"]:
        return "ok", ""
    detail = (f"sha256 of the {'decompressed ' if gzipped else ''}content is {sha256} ({size:,} bytes), "
              f"expected {expected['sha256']} ({int(expected['size']):,} bytes)")
    # A plain file shorter than expected may be cut off; a complete gzip stream is not (a cut one raises EOFError).
    return ("short" if not gzipped and size < int(expected["size"]) else "bad"), detail


# --- transfers ---------------------------------------------------------------------------------------------------


class _Interrupted(Exception):
    """The transfer stopped early; the .part file keeps what arrived."""


class _TransferFailed(Exception):
    def __init__(self, reason: str, transient: bool):
        super().__init__(reason)
        self.transient = transient


def _progress_bar(total: int | None, initial: int, label: str, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # the core (serving) install has no tqdm: no bar
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
    become _Interrupted, with what arrived flushed to part."""
    copied = 0
    bar = _progress_bar(total, offset, label, progress)
    try:
        with open(part, mode) as out:
            while True:
                try:
                    chunk = src.read(CHUNK)
                except (http.client.IncompleteRead, OSError) as e:  # OSError: resets, timeouts
                    raise _Interrupted(f"connection lost after {offset + copied:,} bytes ({e})") from e
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
    earlier bytes of part were kept. Raises _Interrupted or _TransferFailed."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        with e:
            if e.code == 416 and offset:  # nothing after `offset`: the .part is complete, or longer than the file
                _, total = _parse_content_range(e.headers.get("Content-Range", ""))
                if total == offset:
                    return True, True
                log(f"resume    {label}: the server refused the range; downloading again from the start")
                part.unlink()
                return _transfer_http(url, part, timeout=timeout, progress=progress, label=label, log=log)
            raise _TransferFailed(f"HTTP {e.code} {e.reason}", transient=e.code in (408, 425, 429) or e.code >= 500)
    except urllib.error.URLError as e:
        raise _TransferFailed(f"cannot connect ({e.reason})", transient=True) from e
    except (http.client.HTTPException, OSError) as e:
        raise _TransferFailed(f"cannot connect ({e})", transient=True) from e
    with response:
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if offset and response.status == 206:
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
        raise _Interrupted(f"connection closed after {offset + copied:,} of {total:,} bytes")
    return total is not None, offset > 0


def _transfer_file(url: str, part: Path, *, progress: bool, label: str, log) -> tuple[bool, bool]:
    """file:// transfer, resumed by seeking (urllib's file handler ignores Range)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise _TransferFailed(f"file URLs on another host ({parsed.netloc}) are not supported", transient=False)
    source = Path(urllib.request.url2pathname(parsed.path))
    try:
        src = open(source, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise _TransferFailed(f"cannot read {source} ({e.strerror or e})", transient=False) from e
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


def _transfer(url: str, part: Path, **kwargs) -> tuple[bool, bool]:
    if urllib.parse.urlparse(url).scheme == "file":
        kwargs.pop("timeout", None)
        return _transfer_file(url, part, **kwargs)
    return _transfer_http(url, part, **kwargs)


# --- one file ----------------------------------------------------------------------------------------------------


def mirror_base(mirror: str) -> str:
    """A mirror setting as a base URL: URLs stay, a local folder becomes its file:// URL."""
    if urllib.parse.urlparse(mirror).scheme in ("http", "https", "file"):
        return mirror.rstrip("/") + "/"
    return Path(mirror).expanduser().resolve().as_uri().rstrip("/") + "/"


def _advice(mirror: str | None) -> str:
    if mirror:
        return f"check the mirror {mirror}, or run without --mirror / {MIRROR_ENV_VAR} to fetch from upstream"
    return f"fetch from a mirror with --mirror BASE_URL / {MIRROR_ENV_VAR}"


def _install(part: Path, final: Path, downloaded_gzip: bool, want_gzip: bool) -> None:
    """Move the verified part to its final name, gzipping or gunzipping it first if the forms differ."""
    if downloaded_gzip == want_gzip:
        os.replace(part, final)
        return
    tmp = final.with_name(final.name + ".tmp")
    try:
        if want_gzip:  # upstream plain text, loaders read gzip
            with open(part, "rb") as src, open(tmp, "wb") as raw, gzip.GzipFile(
                    filename="", mode="wb", fileobj=raw, mtime=0) as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
        else:  # upstream gzip, loaders read plain
            with gzip.open(part, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    part.unlink()


def fetch_file(f: DataFile, data_dir: Path, expected: Mapping[str, object] | None, *, mirror: str | None = None,
               progress: bool = False, retries: int = 2, backoff: float = 1.0, timeout: float = 60.0,
               log: Callable[[str], None] = print) -> str:
    """Make ``data_dir / f.path`` present and verified: "present" (nothing to do) or "downloaded".
    Raises FetchError with the file, the URL and what to do."""
    final = data_dir / f.path
    part = final.with_name(final.name + ".part")
    url = mirror_base(mirror) + urllib.parse.quote(f.path) if mirror else f.url
    if expected is None:
        raise FetchError(f"{f.path}: no committed checksum (models/data_checksums.py); regenerate it with "
                         f"`python -m models.fetch checksums REFERENCE_DIR --write`")
    if final.exists():
        status, detail = _check_content(final, f.gzip, expected)
        if status == "ok":
            part.unlink(missing_ok=True)  # a leftover of an earlier run
            log(f"ok        {f.path}: present, sha256 verified")
            return "present"
        raise FetchError(f"{final} is present but does not match the committed checksum: {detail}. It is left "
                         f"untouched: delete {final} and rerun `{_FETCH_COMMAND}` (source: {url}), or "
                         f"{_advice(mirror)}")
    downloaded_gzip = f.gzip if mirror else f.upstream_gzip
    final.parent.mkdir(parents=True, exist_ok=True)
    attempt, restarted = 0, False
    while True:
        try:
            complete, resumed = _transfer(url, part, timeout=timeout, progress=progress, label=f.path, log=log)
        except (_Interrupted, _TransferFailed) as e:
            transient = isinstance(e, _Interrupted) or e.transient
            if transient and attempt < retries:
                attempt += 1
                log(f"retry     {f.path}: {e}; attempt {attempt + 1} of {retries + 1}")
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            kept = (f" The {part.stat().st_size:,} bytes received are kept in {part}: rerun `{_FETCH_COMMAND}` to "
                    f"resume, or {_advice(mirror)}.") if part.exists() and part.stat().st_size else (
                    f" Rerun `{_FETCH_COMMAND}`, or {_advice(mirror)}.")
            raise FetchError(f"{f.path}: download from {url} failed: {e}.{kept}") from e
        status, detail = _check_content(part, downloaded_gzip, expected)
        if status == "ok":
            break
        if status == "short" and not complete and attempt < retries:  # length unknown and the content is cut off
            attempt += 1
            log(f"retry     {f.path}: incomplete ({detail}); attempt {attempt + 1} of {retries + 1}")
            time.sleep(backoff * 2 ** (attempt - 1))
            continue
        if status == "short" and not complete:
            raise FetchError(f"{f.path}: download from {url} is incomplete: {detail}. What arrived is kept in "
                             f"{part}: rerun `{_FETCH_COMMAND}` to resume, or {_advice(mirror)}.")
        if resumed and not restarted:  # the earlier part may come from another version of the file
            log(f"restart   {f.path}: the resumed download does not verify ({detail}); downloading again")
            part.unlink()
            restarted = True
            continue
        part.unlink()
        raise FetchError(f"{f.path}: checksum mismatch for {url}: {detail}. The download was discarded and nothing "
                         f"was written to {final}. The source may have changed or the transfer was corrupted: rerun "
                         f"`{_FETCH_COMMAND}`, or {_advice(mirror)}.")
    _install(part, final, downloaded_gzip, f.gzip)
    log(f"fetched   {f.path}: downloaded from {url}, sha256 verified")
    return "downloaded"


# --- all files ---------------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """Where fetched data goes by default: $TSERVE_DATA_DIR, else ./data."""
    return Path(os.environ.get(ENV_VAR) or "data")


def fetch(data_dir: str | os.PathLike | None = None, *, mirror: str | None = None,
          only: Iterable[str] | None = None, files: Iterable[DataFile] | None = None,
          checksums: Mapping[str, Mapping[str, object]] | None = None, progress: bool = False, retries: int = 2,
          backoff: float = 1.0, timeout: float = 60.0, log: Callable[[str], None] = print,
          error_log: Callable[[str], None] | None = None) -> FetchResult:
    """Fetch and verify every file (of the datasets in ``only``); one failure does not stop the others.

    ``mirror`` None reads $TSERVE_DATA_MIRROR (an empty string means upstream). ``files`` and ``checksums``
    default to :data:`FILES` and the committed table (tests pass their own)."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if mirror is None:
        mirror = os.environ.get(MIRROR_ENV_VAR) or None
    mirror = mirror or None
    files = FILES if files is None else tuple(files)
    checksums = _committed_checksums() if checksums is None else checksums
    error_log = error_log or log
    if only:
        unknown = set(only) - {f.dataset for f in files}
        if unknown:
            raise ValueError(f"unknown dataset(s) {sorted(unknown)}; expected some of {DATASETS}")
        files = tuple(f for f in files if f.dataset in set(only))
    result = FetchResult(root.absolute())
    try:
        root.mkdir(parents=True, exist_ok=True)
        result.data_dir = root.resolve()
    except OSError as e:
        message = f"cannot create the data folder {root.absolute()} ({e}); choose another with --data-dir or {ENV_VAR}"
        for f in files:
            result.failed[f.path] = message
        error_log(f"error: {message}")
        return result
    for f in files:
        try:
            outcome = fetch_file(f, root, checksums.get(f.path), mirror=mirror, progress=progress, retries=retries,
                                 backoff=backoff, timeout=timeout, log=log)
        except FetchError as e:
            result.failed[f.path] = str(e)
            error_log(f"error: {e}")
        except OSError as e:  # the data folder itself: permissions, disk full
            result.failed[f.path] = f"{f.path}: cannot write into {root.absolute()} ({e})"
            error_log(f"error: {result.failed[f.path]}")
        else:
            (result.present if outcome == "present" else result.downloaded).append(f.path)
    return result


# --- command line ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Download and verify the training data.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("fetch", help="download every missing file and verify every file (exit 0: all verified)")
    p.add_argument("--data-dir", help=f"where the data goes (default: ${ENV_VAR}, else ./data)")
    p.add_argument("--mirror", help=f"base URL (http(s)://, file:// or a folder) holding the data folder's layout "
                                    f"(default: ${MIRROR_ENV_VAR}, else the upstream repositories)")
    p.add_argument("--only", action="append", choices=DATASETS, help="only this dataset (repeatable)")
    p.add_argument("--quiet", action="store_true", help="errors only: no progress bars, no per-file lines")
    p.add_argument("--retries", type=int, default=2, help="retries of an interrupted download, resuming (default 2)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without data before a connection fails")
    c = commands.add_parser("checksums", help="compute the checksum table from a complete, trusted data folder")
    c.add_argument("reference_dir", help="a complete data folder, e.g. /work/shared/data")
    c.add_argument("--write", action="store_true", help=f"write {CHECKSUMS_MODULE} instead of printing it")
    args = parser.parse_args(argv)

    if args.command == "checksums":
        try:
            text = render_checksums_module(compute_checksums(args.reference_dir))
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.write:
            CHECKSUMS_MODULE.write_text(text)
            print(f"wrote {CHECKSUMS_MODULE}")
        else:
            sys.stdout.write(text)
        return 0

    def log(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    def error_log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = fetch(args.data_dir, mirror=args.mirror, only=args.only, progress=not args.quiet and sys.stderr.isatty(),
                   retries=max(0, args.retries), timeout=args.timeout, log=log, error_log=error_log)
    total = len(result.present) + len(result.downloaded) + len(result.failed)
    if result.ok:
        log(f"{total} files verified in {result.data_dir} ({len(result.downloaded)} downloaded, "
            f"{len(result.present)} already present)")
        return 0
    error_log(f"{len(result.failed)} of {total} files failed in {result.data_dir} (see above); "
              f"{len(result.downloaded) + len(result.present)} verified")
    return 1


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m models.fetch"))
