"""Download the three datasets into the layout :mod:`models.data` reads, verified against committed checksums.

    make data                                     # = python -m models.data fetch
    python -m models.data fetch [--data-dir DIR] [--mirror BASE_URL] [--only NAME ...] [--quiet]
    python -m models.fetch checksums REFERENCE_DIR [--write]   # regenerate models/data_checksums.py

- Where: ``--data-dir``, else ``$TSERVE_DATA_DIR``, else ``./data`` (created if missing).
- From: the upstream GitHub repositories (``raw.githubusercontent.com``, see :data:`models.datasets.FILES`), or a mirror
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

Code: the files and their upstream URLs are :data:`models.datasets.FILES`; the checksums and the digest of a file's
content, :mod:`models.fetch_verify`; the transfers (HTTP with ``Range``, ``file://``), :mod:`models.fetch_transfer`;
this module fetches one file (retries, verification, installation under its final name), then all of them, and runs
the command line.

Upstream compression vs the loaders' names: every current upstream file is already stored in the form the loaders
read (Multi30k and Fashion-MNIST gzip, tinyshakespeare plain text); :class:`~models.datasets.DataFile` records both
forms and the fetcher gzips or gunzips explicitly if they ever differ.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from models.datasets import DATASETS, ENV_VAR, FILES, DataError, DataFile
from models.fetch_transfer import Interrupted, TransferFailed, transfer
from models.fetch_verify import CHECKSUMS_MODULE, CHUNK, check_content, committed_checksums, compute_checksums, \
    render_checksums_module

MIRROR_ENV_VAR = "TSERVE_DATA_MIRROR"
_FETCH_COMMAND = "python -m models.data fetch"


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
        status, detail = check_content(final, f.gzip, expected)
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
            complete, resumed = transfer(url, part, timeout=timeout, progress=progress, label=f.path, log=log)
        except (Interrupted, TransferFailed) as e:
            transient = isinstance(e, Interrupted) or e.transient
            if transient and attempt < retries:
                attempt += 1
                log(f"retry     {f.path}: {e}; attempt {attempt + 1} of {retries + 1}")
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            kept = (f" The {part.stat().st_size:,} bytes received are kept in {part}: rerun `{_FETCH_COMMAND}` to "
                    f"resume, or {_advice(mirror)}.") if part.exists() and part.stat().st_size else (
                    f" Rerun `{_FETCH_COMMAND}`, or {_advice(mirror)}.")
            raise FetchError(f"{f.path}: download from {url} failed: {e}.{kept}") from e
        status, detail = check_content(part, downloaded_gzip, expected)
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
    checksums = committed_checksums() if checksums is None else checksums
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
