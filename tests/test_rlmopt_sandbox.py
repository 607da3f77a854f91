"""The REPL worker's sandbox: a block that opens a socket, reads the parent's files, fork-bombs,
execs, allocates 4 GB, signals another process or loops forever is blocked or killed, and the REPL
keeps serving (tool calls included) and reports what happened."""
import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.sandbox.repl import Repl


@pytest.fixture(scope="module")
def repl():
    calls = []
    r = Repl(lambda name, args, kwargs: calls.append(name) or {"tool": name, "args": args},
             ["peek_examples"], RLMOptConfig(block_timeout_s=1.5, worker_memory_mb=512))
    r.start()
    r.calls = calls
    yield r
    r.close()


def _alive(repl):
    res = repl.run("peek_examples(2)")
    assert res.error is None and "'tool': 'peek_examples'" in res.output


def test_lockdown_holds_here(repl):
    assert repl.holds == {"rlimits": True, "landlock": True, "seccomp": True}, repl.lockdown_errors


def test_state_persists_and_tools_are_rpcs(repl):
    assert repl.run("x = 20").error is None
    assert repl.run("x + 1").output.strip() == "21"
    _alive(repl)
    assert repl.calls[-1] == "peek_examples"


@pytest.mark.parametrize("code, message", [
    ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)", "PermissionError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "PermissionError"),
    ("import os\nwhile True:\n    os.fork()", "PermissionError"),
    ("import subprocess\nsubprocess.run(['/bin/true'])", "PermissionError"),
    ("import os\nos.kill(1, 9)", "PermissionError"),
    ("big = bytearray(4 * 2**30)", "MemoryError"),
])
def test_blocked_and_reported(repl, code, message):
    res = repl.run(code)
    assert res.killed is None and message in (res.error or ""), res
    _alive(repl)


def test_limits_cannot_be_raised(repl):
    res = repl.run("import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n"
                   "except (ValueError, OSError):\n    print('refused')\n"
                   "resource.getrlimit(resource.RLIMIT_AS)")
    assert res.output.split() == ["refused", f"({512 << 20},", f"{512 << 20})"], res


def test_parent_files_outside_its_directory_are_unreadable(repl, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("parent secret")
    for path in (secret, __file__, "/etc/hostname"):
        res = repl.run(f"open({str(path)!r}).read()")
        assert "PermissionError" in (res.error or "") and "parent secret" not in res.output, path
    own = repl.run("open('note.txt', 'w').write('mine'); open('note.txt').read()")
    assert own.output.strip() == "'mine'"


def test_a_flood_on_the_channel_kills_the_worker_not_the_parent(repl):
    res = repl.run("import os\nchunk = b'x' * (1 << 20)\nfor _ in range(40):\n    os.write(4, chunk)\n"
                   "while True:\n    pass")
    assert res.killed and "tool channel" in res.killed, res
    _alive(repl)


def test_a_worker_that_closes_its_channel_is_replaced(repl):
    res = repl.run("import os\nos.close(4)\nwhile True:\n    pass")
    assert res.killed and "channel closed" in res.killed, res
    _alive(repl)


def test_infinite_loop_is_killed_and_the_repl_restarts(repl):
    restarts = repl.restarts
    res = repl.run("y = 1\nwhile True:\n    pass")
    assert res.killed and "1.5 s" in res.killed and repl.restarts == restarts + 1
    assert "NameError" in repl.run("y").error  # a fresh worker
    _alive(repl)


def test_time_spent_serving_tools_does_not_count_against_the_block():
    import time

    def slow(name, args, kwargs):
        time.sleep(1.0)
        return "ok"
    r = Repl(slow, ["slow_tool"], RLMOptConfig(block_timeout_s=1.5))
    r.start()
    try:
        res = r.run("[slow_tool() for _ in range(2)]")
        assert res.killed is None and res.output.strip() == "['ok', 'ok']", res
    finally:
        r.close()
