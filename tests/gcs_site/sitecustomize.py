"""Started by every Python process whose PYTHONPATH holds this directory (tests/gcs_emulator.py puts
it there for the processes a test starts): points fsspec's `gs://` at the emulator's directory, so a
child trainer sees the same buckets as the test (TensorStore finds the emulator's HTTP server by
its own environment variables)."""
import os
import sys

_root = os.environ.get("WORKFLOW_R1_TEST_GCS_ROOT")
if _root:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.gcs_emulator import register_fsspec

    register_fsspec(_root)
    del sys.path[0]
