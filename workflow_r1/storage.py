"""Where a run's files go and its inputs come from: a local path or a URI (`gs://bucket/run`), through
one path type.

Every output of a run (checkpoints, metrics.jsonl, TensorBoard, trajectories, eval, the HF export,
config.json, summary.json, profiler traces) is written through `path(...)`, an `etils.epath.Path`:
the path type orbax itself uses, so checkpoints (arrays through TensorStore's own GCS driver) and
every other file agree on what `gs://b/x` means. A URI is never turned into a local path
(`pathlib.Path("gs://b/x")` would be the relative directory `gs:/b/x` on each worker's disk).

Remote file systems cannot append and some libraries write only local files (tensorboardX's event
writer, jax.profiler, safetensors), so: `write_text` writes a whole file as one object, and
`staged(dest)` gives those libraries a local directory that is copied to `dest` when the block ends
(for a local `dest`, it is `dest` itself). `gs://` needs gcsfs and google-cloud-storage
(`requirements-cloud.txt`); local paths need nothing more.

Inputs are read the same way: `source(p)` is the path to read (a local one with `~` expanded), and
`reading(given, what)` turns a failure to reach it (missing, the cloud requirements absent, no
permission or credentials) into one line naming the path as the user wrote it. Readers that need a
local directory (transformers' tokenizer) get one from `fetched(src)`: the
directory itself when local, else a temporary download of the files they read, deleted afterwards.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from etils import epath

Path = epath.Path
PathLike = str | os.PathLike


def is_remote(p: PathLike) -> bool:
    """True for a URI with a scheme (gs://, s3://, ...), False for a local path."""
    return "://" in os.fspath(p)


def path(p: PathLike, *, absolute: bool = False) -> epath.Path:
    """`p` as an epath.Path: a URI stays a URI; a local path is made absolute when asked (orbax
    wants absolute local paths)."""
    out = epath.Path(p)
    return out if is_remote(p) or not absolute else out.absolute()


def source(p: PathLike) -> epath.Path:
    """`p` as a path to read: a URI stays one; a local path has `~` expanded."""
    return epath.Path(p) if is_remote(p) else epath.Path(os.path.expanduser(os.fspath(p)))


def refuse_special(p: PathLike, what: str, error: type[Exception] = ValueError) -> int:
    """The size in bytes of the local file `p`, refused in one line when it is no regular file.

    A FIFO would block a reader forever, and a link to a device such as /dev/zero would fill its
    memory; `epath.Path.is_file()` says only "exists and is no directory". URIs are not checked
    (their size is returned as 0)."""
    import stat

    if is_remote(p):
        return 0
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {os.fspath(p)}: not a regular file (a pipe, socket or device); copy its contents "
                    "into a file")
    return st.st_size


class ReadError(ValueError):
    """An input (a local path or a URI) that is missing or cannot be read; one line naming it as given."""


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextlib.contextmanager
def reading(given: PathLike, what: str, error: type[Exception] = ReadError) -> Iterator[None]:
    """Raises `error("<what> <given>: ...")`, one line, when the block fails to reach `given`: not
    found; a URI whose file system is not installed (gs:// without gcsfs: the fix is
    requirements-cloud.txt); any other failure of a URI's client (permission, credentials, network)
    or a local OSError. A ValueError passes through (the caller's own one-line errors)."""
    try:
        yield
    except ValueError:
        raise
    except FileNotFoundError:
        raise error(f"{what} {os.fspath(given)}: not found") from None
    except ImportError as exc:
        if not is_remote(given):
            raise
        scheme = os.fspath(given).split("://", 1)[0]
        raise error(f"{what} {os.fspath(given)}: reading {scheme}:// needs its file system ({_reason(exc)}); "
                    "pip install -r requirements-cloud.txt") from None
    except Exception as exc:  # a remote client raises its own types (HTTP, auth); locally only OSError is I/O
        if not (is_remote(given) or isinstance(exc, OSError)):
            raise
        raise error(f"{what} {os.fspath(given)}: cannot be read ({_reason(exc)})") from None


@contextlib.contextmanager
def fetched(src: PathLike, wanted: Callable[[str], bool], what: str = "directory") -> Iterator[epath.Path]:
    """A local directory holding the files of the directory `src` whose names `wanted` accepts:
    `src` itself when it is local; for a URI, a temporary directory (under TMPDIR) they are downloaded
    to, its free space checked first, deleted when the block ends. Failures are one ReadError line
    naming `src`."""
    if not is_remote(src):
        yield source(src)
        return
    remote = source(src)
    with reading(src, what):
        stats = [(f, f.stat()) for f in sorted(remote.iterdir()) if wanted(f.name)]
    files = [(f, st.length) for f, st in stats if not st.is_directory]
    local = tempfile.mkdtemp(prefix="workflow_r1-fetched-")
    try:
        need, free = sum(n for _, n in files), shutil.disk_usage(local).free
        if free < need + (64 << 20):
            raise ReadError(f"{what} {os.fspath(src)}: its files take {need / 1e9:.2f} GB, {free / 1e9:.2f} GB "
                            f"free in {local}; set TMPDIR to a larger disk")
        with reading(src, what):
            for f, _ in files:
                with f.open("rb") as r, open(os.path.join(local, f.name), "wb") as w:
                    shutil.copyfileobj(r, w, 16 << 20)
        yield path(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def write_text(p: PathLike, text: str) -> None:
    """Writes the whole file `p` (creating its parent): locally through a temporary file renamed into
    place, so a reader (or a killed run) never sees half a file; remotely as one object upload."""
    p = path(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(p):
        p.write_text(text, encoding="utf-8")
        return
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)


def copy_file(src: PathLike, dest: PathLike) -> None:
    """Copies the local file `src` to `dest` (local or remote), replacing what is there."""
    dest = path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(dest):
        with open(src, "rb") as f, dest.open("wb") as g:
            shutil.copyfileobj(f, g, 16 << 20)
    else:
        shutil.copyfile(src, dest)


def copy_tree(src: PathLike, dest: PathLike) -> None:
    """Copies every file under the local directory `src` to the same relative path under `dest`."""
    for dirpath, _, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for name in files:
            copy_file(os.path.join(dirpath, name), path(dest) / ("" if rel == "." else rel) / name)


@contextlib.contextmanager
def staged(dest: PathLike) -> Iterator[epath.Path]:
    """A local directory for writers that need one: `dest` itself when it is local (not created: the
    writer creates it, so a check inside the block sees it as it was), else a temporary directory whose
    files are copied to `dest` when the block ends without an error (and then deleted either way)."""
    if not is_remote(dest):
        yield path(dest)
        return
    local = tempfile.mkdtemp(prefix="workflow_r1-staged-")
    try:
        yield path(local)
        copy_tree(local, dest)
    finally:
        shutil.rmtree(local, ignore_errors=True)


__all__ = ["Path", "ReadError", "copy_file", "copy_tree", "fetched", "is_remote", "path", "reading", "source", "staged",
           "write_text"]
