"""A rollout's KV page pool against the memory it will live in (workflow_r1/memory_fit.py): refused
in one line at the trainer's start when no device could hold it, measured against a real pool."""
from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import pytest

from workflow_r1 import memory_fit
from workflow_r1.rollout import RolloutConfig

GIB = 1 << 30


class _Chip:
    """An accelerator as memory_fit sees one: its allocator's limit."""

    platform = "tpu"

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_a_pool_larger_than_a_device_is_one_line_naming_the_keys(monkeypatch):
    cfg = RolloutConfig(max_prompt_tokens=1024, max_response_tokens=(1 << 20) - 1024, page_size=64)
    per_row = cfg.pages_per_row
    assert per_row == 16384
    # 8 rows of 16,384 pages of 1 MiB: 128 GiB (+ the scratch page) against one 95 GiB chip.
    with pytest.raises(ValueError) as e:
        memory_fit.check_page_pool(cfg, 8, 1 << 20, [_Chip(95 * GIB)] * 4, "a training step's rollout")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "a training step's rollout: its KV page pool needs 128.00 GiB "
        "(131072 pages of 64 tokens, 1048576 bytes a page a device: 8 rows in flight")
    assert "one TPU device's 95.00 GiB" in msg and "rollout.max_rows_in_flight" in msg
    memory_fit.check_page_pool(cfg, 8, 1 << 20, [_Chip(129 * GIB)], "x")  # fits: no error
    # Fewer rows in flight, or a set page budget, size the pool instead.
    memory_fit.check_page_pool(dataclasses.replace(cfg, max_rows_in_flight=4), 8, 1 << 20, [_Chip(95 * GIB)], "x")
    with pytest.raises(ValueError, match=r"\(200000 pages of 64 tokens, 1048576 bytes a page a device: "
                                         r"rollout.kv_cache_pages\)"):
        memory_fit.check_page_pool(dataclasses.replace(cfg, kv_cache_pages=200_000), 1, 1 << 20, [_Chip(95 * GIB)], "x")
    # CPU devices share the host's memory: one copy per device.
    cpus = jax.local_devices()[:4]
    monkeypatch.setattr(memory_fit, "device_memory", lambda d: 300 * GIB)
    with pytest.raises(ValueError, match=r"needs 512.00 GiB .* the host's 300.00 GiB available, holding every CPU "
                                         r"device's share \(4\)"):
        memory_fit.check_page_pool(cfg, 8, 1 << 20, cpus, "x")
    memory_fit.check_page_pool(cfg, 8, 1 << 20, cpus[:2], "x")  # 256 GiB: fits


def test_the_host_memory_of_cpu_devices_is_what_is_available_now():
    """Not the machine's total: a pool must fit what the model and other processes leave."""
    def meminfo(key):
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024

    have = memory_fit.device_memory(jax.local_devices()[0])
    assert have is not None and abs(have - meminfo("MemAvailable")) < 256 << 20
    assert have < meminfo("MemTotal")
    assert memory_fit.device_memory(_Chip(7)) == 7


def test_the_trainer_refuses_a_pool_no_device_holds_before_any_rollout(tmp_path, monkeypatch):
    """The tiny preset with a response budget inside the config's range (2^20 tokens a row) but a pool
    beyond the (here: 1 GiB) memory: refused at start, before the executor starts or anything is
    written; the measured bytes per page are a real pool's."""
    from tests.test_train import _trainer
    from workflow_r1.sampler import Sampler

    seen = {}
    real = memory_fit.check_page_pool

    def spy(cfg, rows, bytes_per_page, devices, what):
        seen.setdefault(what, (rows, bytes_per_page, len(devices)))
        return real(cfg, rows, bytes_per_page, devices, what)

    monkeypatch.setattr(memory_fit, "device_memory", lambda d: GIB)
    monkeypatch.setattr(memory_fit, "check_page_pool", spy)
    started = []
    monkeypatch.setattr("workflow_r1.rollout.engine.RolloutEngine.__init__", lambda *a, **k: started.append(1))
    with pytest.raises(ValueError) as e:
        _trainer(tmp_path / "w", 1, ["rollout.max_response_tokens=1000000"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("a training step's rollout: its KV page pool needs ")
    assert "more than the host's 1.00 GiB" in msg and not started
    rows, bytes_per_page, copies = seen["a training step's rollout"]
    assert rows == 4 and copies >= 1  # 2 questions x 2 samples on this host
    # The bytes per page are what a real pool of this model takes: K and V of each layer.
    from workflow_r1 import policy

    model, tok = policy.load(policy.ModelConfig(preset="tiny-chat"))
    pool = Sampler(model, tok, cache_size=256).new_pages(7, 64)
    assert pool.nbytes == 8 * bytes_per_page
    c = model.cfg
    assert bytes_per_page >= 2 * c.num_layers * c.num_kv_heads * c.head_dim * 64 * 2  # at least bf16 K and V
    assert math.isclose(pool.nbytes / 8, bytes_per_page)


def test_a_device_holds_its_share_of_pages_split_over_kv_heads():
    """A tensor-parallel sampler's TPU-native pages are split over KV heads: a device holds its share."""
    import types

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    two = jax.local_devices()[:2]
    mesh = Mesh(np.array(two), ("tensor",))
    split = jax.device_put(jnp.zeros((3, 64, 4, 16)), NamedSharding(mesh, PartitionSpec(None, None, "tensor")))
    whole = jax.device_put(jnp.zeros((3, 64, 4, 16)), NamedSharding(mesh, PartitionSpec()))
    assert memory_fit.per_device_bytes(types.SimpleNamespace(k=(split,), v=None), two[1]) == split.nbytes // 2
    assert memory_fit.per_device_bytes(types.SimpleNamespace(k=(whole,), v=(whole,)), two[0]) == 2 * whole.nbytes
    assert memory_fit.per_device_bytes(types.SimpleNamespace(k=np.zeros(10, np.float32), v=None), two[0]) == 40


def test_the_paper_presets_pool_fits_a_v5p_chip():
    """The paper preset's rows in flight (256 per host) at their whole budget, each page split over a
    v5p host's 4 chips (Qwen2.5-7B: 28 layers x K+V x 4 KV heads x 128 x bf16 = 57,344 bytes a token,
    docs/replicate.md): 37,888 pages, 32.38 GiB of a 95 GiB chip, accepted at start; 4x the rows are not."""
    import pathlib

    from workflow_r1 import configlib

    spec = pathlib.Path(__file__).resolve().parents[1] / "configs" / "gsspo.py"
    cfg = configlib.to_dataclass(RolloutConfig, configlib.load(f"{spec}:paper").rollout, "rollout")
    assert cfg.max_rows_in_flight == 256 and cfg.page_budget(256) == 37_888
    per_page = 28 * 2 * 4 * 128 * 2 * cfg.page_size // 4
    assert round((cfg.page_budget(256) + 1) * per_page / GIB, 2) == 32.38
    memory_fit.check_page_pool(cfg, 2048, per_page, [_Chip(95 * GIB)] * 4, "x")  # a v5p-16 host's 2,048 rows
    memory_fit.check_page_pool(cfg, 4096, per_page, [_Chip(95 * GIB)] * 4, "x")  # a v5p-8's 4,096
    with pytest.raises(ValueError, match="1024 rows in flight"):
        memory_fit.check_page_pool(dataclasses.replace(cfg, max_rows_in_flight=1024), 4096, per_page,
                                   [_Chip(95 * GIB)] * 4, "x")


def test_evaluate_refuses_a_pool_the_memory_cannot_hold_before_any_rollout(tmp_path, monkeypatch):
    """`python -m workflow_r1.evaluate` runs the same check as the trainer, on its evaluation batch."""
    from workflow_r1 import configlib, run_config
    from workflow_r1.data.questions import bundled_questions, write_questions
    from workflow_r1.eval import job

    monkeypatch.setattr(memory_fit, "device_memory", lambda d: GIB)
    started = []
    monkeypatch.setattr("workflow_r1.rollout.engine.RolloutEngine.__init__", lambda *a, **k: started.append(1))
    root = pathlib.Path(__file__).resolve().parents[1]
    run = run_config.Run.from_config(configlib.load(f"{root}/configs/gsspo.py:tiny", [
        "rollout.max_response_tokens=1000000", "eval.batch_size=4", "mesh.tensor=2"]))
    data = write_questions(bundled_questions()[:2], tmp_path / "qs.jsonl")
    with pytest.raises(ValueError) as e:
        job.evaluate_run(run, data=str(data), method="direct")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("an evaluation batch's rollout: its KV page pool needs ")
    assert "more than the host's 1.00 GiB available" in msg and not started
