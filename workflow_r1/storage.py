"""Where a run's files go: a local directory or a URI (`gs://bucket/run`), through one path type.

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
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

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


__all__ = ["Path", "copy_file", "copy_tree", "is_remote", "path", "staged", "write_text"]
