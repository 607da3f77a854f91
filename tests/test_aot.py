"""workflow_r1.aot: topology names, the fit rule, and (with libtpu installed) a real ahead-of-time
compilation of the 0.5B's programs for a v5e:2x2 slice, with a config that does not fit failing in
one line."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from workflow_r1 import aot
from workflow_r1.model.config import get_preset

REPO = pathlib.Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -r requirements-tpu.txt): the AOT check compiles for TPU chips")


@pytest.mark.parametrize("name, want", [
    ("v5p-16", "v5p:2x2x2"),   # v5p names count TensorCores, 2 per chip: 8 chips
    ("v5p-8", "v5p:1x2x2"),
    ("v5p-128", "v5p:4x4x4"),
    ("v5e-16", "v5e:4x4"),     # v5e / v6e names count chips
    ("v5e-4", "v5e:2x2"),
    ("v6e-8", "v6e:2x4"),
    ("v5litepod-16", "v5e:4x4"),
    ("v5p:2x2x4", "v5p:2x2x4"),
])
def test_topology_names(name, want):
    assert aot.topology_string(name)[1] == want


@pytest.mark.parametrize("name", ["v9-16", "v5p-6", "v5e-12", "tpu"])
def test_bad_topology_is_one_line_naming_the_form(name):
    with pytest.raises(aot.AotError, match="topology") as e:
        aot.topology_string(name)
    assert "\n" not in str(e.value)


def test_fit_rule_counts_every_live_buffer():
    chip = aot.CHIPS["v5e"]
    gib = 1 << 30
    ok = aot.Report("update", 6 * gib, 6 * gib, 6 * gib, 3 * gib, 5 * gib, 0, 0, 0, "train.micro_batch_size")
    assert ok.total == 14 * gib and aot.check_fit([ok], chip, 0.95) is None
    over = aot.Report("decode", 6 * gib, 6 * gib, 5 * gib, 4 * gib, 5 * gib, 0, 0, 0, "rollout.n")  # 16 GiB
    msg = aot.check_fit([ok, over], chip, 0.95)
    assert msg.startswith("error: decode needs 16.00 GiB") and "rollout.n" in msg and "\n" not in msg


def test_roofline_is_the_slower_of_compute_and_memory():
    chip = aot.CHIPS["v5p"]
    p = aot.Report("decode", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=459e9, min_bytes=2.765e12 * 3)
    assert aot.roofline_s(p, chip) == pytest.approx(3.0)  # 1 ms of compute, 3 s of HBM reads
    p = aot.Report("update", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=459e12 * 2, min_bytes=2.765e12)
    assert aot.roofline_s(p, chip) == pytest.approx(2.0)


def _aot(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the tests' 8 simulated CPU devices are not the slice
    env.pop("JAX_PLATFORMS", None)
    return subprocess.run([sys.executable, "-m", "workflow_r1.aot", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)


def _row(out: str, name: str) -> list[float]:
    line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
    return [float(x.rstrip("%")) for x in line.split()[1:]]


@needs_libtpu
def test_05b_compiles_for_v5e_2x2_and_reports_memory():
    """The local preset's 0.5B with a short budget, FSDP over the 4 chips, layers scanned."""
    p = _aot("--config=configs/gsspo.py:local", "--topology=v5e:2x2", "--config.model.scan_layers=True",
             "--config.train.mesh_data=1", "--config.train.mesh_fsdp=-1", "--config.rollout.n=4",
             "--config.rollout.max_prompt_tokens=256", "--config.rollout.max_response_tokens=256",
             "--config.rollout.max_turn_tokens=64", "--config.rollout.pad_multiple=256")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "v5e:2x2: 4 chips, 16.00 GiB HBM" in out and "'fsdp': 4" in out
    # Closed form: fp32 params + two AdamW moments of Qwen2.5-0.5B's 494,032,768 parameters, split
    # 4 ways (the only undivided arrays are the small norm scales and biases).
    n = get_preset("qwen2.5-0.5b").num_params
    assert n == 494_032_768
    state_gib = 3 * 4 * n / 4 / 2**30
    update = _row(out, "update")
    args, outputs, aliased, temps, resident, total = update[:6]
    assert state_gib <= args <= state_gib * 1.02 + 0.05  # + the batch, a few MiB
    assert aliased >= state_gib * 0.98  # the state is donated: written in place
    assert temps > 0 and total == pytest.approx(args + outputs - aliased + temps + resident, abs=0.02)
    for prog in ("prefill", "decode"):
        row = _row(out, prog)
        assert row[4] == pytest.approx(state_gib, rel=0.02, abs=0.02)  # the train state lives through rollout
        assert 0 < row[5] < 16 * 0.95


@needs_libtpu
def test_a_config_that_does_not_fit_fails_in_one_line():
    # 4,096 rows in flight of 1,344 cache slots: the 0.5B's KV cache alone is ~17 GiB per v5e chip.
    p = _aot("--config=configs/gsspo.py:local", "--topology=v5e-4", "--programs=prefill",
             "--config.rollout.prompts_per_step=512", "--config.rollout.n=8")
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    # Over HBM either by XLA's memory analysis or, earlier, by the TPU compiler's own refusal.
    assert re.match(r"error: prefill (needs [\d.]+ GiB per device, over 95% of the 16.00 GiB HBM|does not fit: "
                    r"the TPU compiler needs .+ HBM); change rollout.prompts_per_step / rollout.n \(rows in flight\)",
                    last), last
