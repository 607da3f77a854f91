"""Error lines that say what happened: the free-space margin, the values a config actually has, and a
URI work directory whose file system is not installed (the fix named, no traceback)."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from workflow_r1 import checkpointing as ckpt

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_free_space_error_states_its_margin(tmp_path, free_disk):
    need = 1_000_000_000  # 1 GB: the margin is 2% (20 MB) and 16 MiB (16.8 MB)
    free_disk(need)  # the bytes themselves fit, the margin does not
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.check_free_space(tmp_path / "ckpt", need, "checkpoint step 3")
    assert str(e.value) == (f"not enough disk space for checkpoint step 3 in {tmp_path / 'ckpt'}: it needs about "
                            "1.00 GB plus a margin of 36.8 MB (2% and 16 MiB for metadata), 1.00 GB free on "
                            f"{tmp_path}; free some space or point --workdir at a larger disk")
    free_disk(need + 36_777_217)
    ckpt.check_free_space(tmp_path / "ckpt", need, "checkpoint step 3")


def test_operator_task_names_the_values_it_got():
    from workflow_r1.envs import operators
    from workflow_r1.rollout import RolloutConfig

    cfg = RolloutConfig(**{**operators.ROLLOUT, "max_response_tokens": 64, "pad_multiple": 8})
    with pytest.raises(ValueError) as e:
        operators.OperatorTaskEnvironment(cfg)
    line = str(e.value)
    assert line.endswith(" (got rollout.max_response_tokens=64, rollout.pad_multiple=8); set them with --config."), line
    assert line.startswith("the operator task needs rollout.max_prompt_tokens=2, rollout.max_response_tokens=16, ")
    operators.OperatorTaskEnvironment(RolloutConfig(**operators.ROLLOUT))


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_gs_workdir_without_the_cloud_requirements_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workflow_r1.train", "--config=configs/gsspo.py:tiny",
                           "--workdir=gs://bucket/run", "--config.steps=1"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: work directory gs://bucket/run: reading gs:// needs its file system (")
    assert lines[0].endswith("; pip install -r requirements-cloud.txt")
