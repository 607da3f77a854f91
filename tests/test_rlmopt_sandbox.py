"""The REPL worker's sandbox: a block that opens a socket, reads the parent's files, fork-bombs,
execs, allocates 4 GB, signals another process or loops forever is blocked or killed, and the REPL
keeps serving (tool calls included) and reports what happened. The attacks of issue #29 (signals,
files outside, root privileges, forged channel lines, escaping the block clock) follow at the end."""
import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.sandbox import layers
from rlmopt.sandbox.repl import WORKER, Repl


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
    """Every layer holds on the CI machine (the user switch where the tests run as root, as in CI),
    and the report says so."""
    root = os.geteuid() == 0
    assert repl.holds == {"rlimits": True, "capabilities": True, "user": root, "landlock": True,
                          "seccomp": True}, repl.lockdown_errors
    report = repl.sandbox_report()
    assert report["mode"] == "strict" and set(report["in_force"]) >= set(report["promised"])


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


# -- attacks from issue #29: each was seen to succeed before its fix ---------------------------------

_NR = {"x86_64": {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
                  "rt_tgsigqueueinfo": 297, "pidfd_open": 434, "pidfd_send_signal": 424,
                  "settimeofday": 164, "reboot": 169, "kexec_load": 246, "init_module": 175,
                  "finit_module": 313, "delete_module": 176, "swapoff": 168, "sethostname": 170}}
needs_x86 = pytest.mark.skipif(os.uname().machine not in _NR,
                               reason="the syscall numbers in these tests are x86_64's")
_SYSCALLS = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "libc.syscall.restype = ctypes.c_long\nNR = {nr!r}\n"
             "def sys_errno(name, *args):\n"
             "    ctypes.set_errno(0)\n"
             "    return 0 if libc.syscall(NR[name], *args) >= 0 else ctypes.get_errno()\n")


@needs_x86
def test_no_signal_reaches_another_process(repl):
    """kill/tgkill/tkill, rt_sigqueueinfo, rt_tgsigqueueinfo and pidfd_open + pidfd_send_signal
    to a process the parent started: all EPERM, and the process lives."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = _SYSCALLS.format(nr=_NR["x86_64"]) + textwrap.dedent(f"""\
            import signal
            pid = {victim.pid}
            info = (ctypes.c_int * 32)(signal.SIGKILL, 0, -1)  # si_signo, si_errno, si_code=SI_QUEUE
            fd = libc.syscall(NR["pidfd_open"], pid, 0)
            {{"kill": sys_errno("kill", pid, signal.SIGKILL),
             "tgkill": sys_errno("tgkill", pid, pid, signal.SIGKILL),
             "tkill": sys_errno("tkill", pid, signal.SIGKILL),
             "rt_sigqueueinfo": sys_errno("rt_sigqueueinfo", pid, signal.SIGKILL, info),
             "rt_tgsigqueueinfo": sys_errno("rt_tgsigqueueinfo", pid, pid, signal.SIGKILL, info),
             "pidfd_open": 0 if fd >= 0 else ctypes.get_errno(),
             "pidfd_send_signal": sys_errno("pidfd_send_signal", max(fd, 0), signal.SIGKILL, None, 0),
             "group": sys_errno("kill", 0, signal.SIGCONT)}}""")
        res = repl.run(code)
        assert res.error is None, res
        assert eval(res.output) == dict.fromkeys(
            ["kill", "tgkill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open",
             "pidfd_send_signal", "group"], errno.EPERM), res.output
        time.sleep(0.05)
        assert victim.poll() is None, "the worker killed a process outside the sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert repl.run("import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: print('own'))\n"
                    "os.kill(os.getpid(), signal.SIGUSR1)").output.strip() == "own"
    _alive(repl)


def _kernel_landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))  # ..._VERSION


@pytest.mark.skipif(_kernel_landlock_abi() < 3, reason="Landlock covers truncate from ABI 3 on; "
                    "this kernel has less (docs/rlmopt.md, Sandbox)")
def test_files_outside_cannot_be_truncated_chmodded_chowned_or_touched(repl):
    """A world-writable parent file in a world-writable directory (so only the sandbox, not file
    permissions, can stop the worker): truncate, open for writing, chmod, chown and utime all fail
    and the file is unchanged. chmod/chown/utime fail on the worker's own files too."""
    outside = tempfile.mkdtemp(prefix="rlmopt-outside-")
    try:
        os.chmod(outside, 0o777)
        path = os.path.join(outside, "parent.txt")
        with open(path, "w") as fh:
            fh.write("p" * 300)
        os.chmod(path, 0o666)
        os.utime(path, (1_000_000, 1_000_000))
        before = os.stat(path)
        code = textwrap.dedent(f"""\
            import os
            P = {path!r}
            def errno_of(fn):
                try:
                    fn()
                    return "done"
                except OSError as exc:
                    return exc.errno
            open("mine.txt", "w").write("m")
            fd = os.open("mine.txt", os.O_RDONLY)
            {{"truncate": errno_of(lambda: os.truncate(P, 7)),
             "open_w": errno_of(lambda: open(P, "r+")),
             "chmod": errno_of(lambda: os.chmod(P, 0o777)),
             "chown": errno_of(lambda: os.chown(P, os.getuid(), os.getgid())),
             "utime": errno_of(lambda: os.utime(P, (0, 0))),
             "utime_now": errno_of(lambda: os.utime(P)),
             "own_chmod": errno_of(lambda: os.chmod("mine.txt", 0o777)),
             "own_fchmod": errno_of(lambda: os.fchmod(fd, 0o777)),
             "own_chown": errno_of(lambda: os.chown("mine.txt", os.getuid(), os.getgid())),
             "own_utime": errno_of(lambda: os.utime("mine.txt", (0, 0)))}}""")
        res = repl.run(code)
        assert res.error is None, res
        got = eval(res.output)
        assert all(v in (errno.EACCES, errno.EPERM) for v in got.values()), got
        after = os.stat(path)
        assert (after.st_size, after.st_mode, after.st_mtime, after.st_uid) == \
               (before.st_size, before.st_mode, before.st_mtime, before.st_uid)
    finally:
        shutil.rmtree(outside)


def test_landlock_uses_the_kernels_abi(repl):
    abi = _kernel_landlock_abi()
    if abi < 1:
        pytest.skip("this kernel has no Landlock")
    assert repl.lockdown_info["landlock_abi"] == abi


@needs_x86
def test_no_privilege_is_left(repl):
    """Started as root, the worker runs as an unprivileged user with every capability set empty;
    setting the clock, a block device node, modules, reboot, kexec, swapoff, sethostname fail."""
    code = _SYSCALLS.format(nr=_NR["x86_64"]) + textwrap.dedent("""\
        import stat
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        caps = (ctypes.c_uint32 * 6)()
        assert libc.capget(hdr, caps) == 0
        bounding = [c for c in range(64) if libc.prctl(23, c, 0, 0, 0) == 1]  # PR_CAPBSET_READ
        ambient = [c for c in range(64) if libc.prctl(47, 1, c, 0, 0) == 1]  # PR_CAP_AMBIENT_IS_SET
        try:
            os.mknod("blk", stat.S_IFBLK | 0o600, os.makedev(7, 0))
            mknod = 0
        except OSError as exc:
            mknod = exc.errno
        # Each call below checks its capability before its arguments, which are invalid, so the
        # call is harmless where it is allowed (EINVAL, ENOENT ...) and EPERM where it is not.
        {"uid": (os.getuid(), os.geteuid(), os.getgid(), os.getegid()), "caps": list(caps),
         "bounding": bounding, "ambient": ambient, "mknod": mknod,
         "settimeofday": sys_errno("settimeofday", None, None),
         "reboot": sys_errno("reboot", 0, 0, 0, None),
         "kexec_load": sys_errno("kexec_load", 0, 0, None, 0x8000),
         "init_module": sys_errno("init_module", None, 0, b""),
         "finit_module": sys_errno("finit_module", -1, b"", 0),
         "delete_module": sys_errno("delete_module", b"rlmopt_no_such_module", 0),
         "swapoff": sys_errno("swapoff", b"/rlmopt-no-such-swap"),
         "sethostname": sys_errno("sethostname", b"x", -1)}""")
    res = repl.run(code)
    assert res.error is None, res
    got = eval(res.output)
    if os.geteuid() == 0:
        assert 0 not in got["uid"], got["uid"]
        assert got["bounding"] == [], got["bounding"]
    assert got["caps"] == [0] * 6 and got["ambient"] == [], got
    denied = {k: v for k, v in got.items() if k not in ("uid", "caps", "bounding", "ambient")}
    assert denied == dict.fromkeys(denied, errno.EPERM), denied
    assert repl.holds["capabilities"] and repl.holds["user"] == (os.geteuid() == 0), \
        repl.lockdown_errors


def test_stdlib_imports_still_work_after_the_lockdown(repl):
    res = repl.run("import datetime, decimal, fractions, difflib, csv, heapq, bisect, hashlib\n"
                   "import xml.dom.minidom, sqlite3, zlib, base64, uuid, enum, dataclasses\n"
                   "str(decimal.Decimal(1) / 7)[:5], difflib.SequenceMatcher(None, 'ab', 'abc').ratio()")
    assert res.error is None and res.output.strip() == "('0.142', 0.8)", res


def test_a_forged_channel_line_does_not_raise(repl):
    """A 10^5-deep JSON line, non-JSON, tool calls with the wrong argument types or 200-deep
    arguments, and a forged done: the block ends normally, none of the forged calls reaches the
    harness, and a real tool call still gets its own answer (not one meant for a forged call)."""
    before = len(repl.calls)
    code = textwrap.dedent("""\
        import os
        os.write(4, b"[" * 100000 + b"]" * 100000 + b"\\n")
        os.write(4, b'{"op": "tool", "id": -3, "name": "peek_examples", "args": ' + b"[" * 200
                 + b"]" * 200 + b'}\\n')
        os.write(4, b'{"op": "tool", "id": 0, "name": "peek_examples", "args": ' + b"[" * 100000
                 + b"]" * 100000 + b'}\\n')
        os.write(4, b"\\xff\\xfe not json\\n")
        os.write(4, b'{"op": "tool", "id": -1, "name": "peek_examples", "args": 5, "kwargs": [1]}\\n')
        os.write(4, b'{"op": "tool", "id": -2, "name": 7, "args": [], "kwargs": {"a": {"b": [[[]]]}}}\\n')
        os.write(4, b'{"op": "done", "output": {"not": "a string"}, "error": 5}\\n')
        print(peek_examples(2))""")
    res = repl.run(code)
    assert res.killed is None and res.error is None, res
    assert res.output.strip() == "{'tool': 'peek_examples', 'args': [2]}", res
    assert repl.calls[before:] == ["peek_examples"]
    _alive(repl)


def test_a_forged_done_does_not_end_the_block(repl):
    res = repl.run("import os, time\nos.write(4, b'{\"op\": \"done\", \"output\": \"forged\", "
                   "\"error\": null}\\n')\ntime.sleep(0.3)\nprint('real')")
    assert res.output.strip() == "real", res


def test_tool_time_counts_against_the_block():
    """One wall-clock cap per block: a block whose tool calls take longer than block_timeout_s is
    killed, however the time divides between the worker and the harness."""
    def slow(name, args, kwargs):
        time.sleep(0.4)
        return "ok"
    r = Repl(slow, ["slow_tool"], RLMOptConfig(block_timeout_s=1.0))
    r.start()
    try:
        assert r.run("slow_tool()").output.strip() == "'ok'"
        res = r.run("for _ in range(10):\n    slow_tool()")
        assert res.killed and "1 s" in res.killed, res
    finally:
        r.close()


def test_nothing_runs_between_blocks(repl):
    """Code that ends its block early (a done forged with the nonce read from the worker's own
    frames) keeps no CPU between blocks: the worker is stopped until the next block."""
    code = textwrap.dedent("""\
        import os, sys, json, time
        f, nonce = sys._getframe(), None
        while f is not None and nonce is None:
            nonce = (f.f_locals.get("msg") or {}).get("nonce") if isinstance(f.f_locals.get("msg"), dict) else None
            f = f.f_back
        stamps = []
        os.write(4, (json.dumps({"op": "done", "output": "early", "error": None, "nonce": nonce}) + "\\n").encode())
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            stamps.append(time.monotonic())
            time.sleep(0.005)""")
    first = repl.run(code)
    assert first.output == "early", first  # the nonce is readable from inside: it does end the block
    t1 = time.monotonic()
    time.sleep(0.8)
    t2 = time.monotonic()
    res = repl.run("stamps")
    assert res.error is None, res
    stamps = eval(res.output)
    assert stamps and not [s for s in stamps if t1 < s < t2], "the worker ran between blocks"


def test_threads_are_refused(repl):
    res = repl.run("import threading\nthreading.Thread(target=lambda: None).start()")
    assert res.killed is None and "can't start new thread" in (res.error or ""), res
    _alive(repl)


# -- the harness never blocks on the worker (issue #50) ---------------------------------------------

_FORGE = textwrap.dedent("""\
    import json, os
    pad = "p" * 4096
    for k in range({n}):
        os.write(4, (json.dumps({{"op": "tool", "id": -k, "name": "peek_examples", "args": [pad],
                                  "kwargs": {{}}}}) + "\\n").encode() * {per_write})
    while True:
        pass""")


def _run_guarded(r, code, limit_s=60.0):
    """r.run(code) in a thread; fails (instead of hanging the suite) if it has not returned within
    limit_s, a hang guard far above any block cap used here."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(res=r.run(code)), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), "the harness is blocked on the worker past its block cap"
    return out["res"]


def test_forged_tool_calls_that_fill_the_pipe_end_at_the_block_cap():
    """A block forges 100 tool calls whose results (4 kB each, 400 kB in all: six 64 KiB pipes)
    it never reads: the harness's writes must not block, the block ends at its cap with one line
    saying so, and the next block runs in a fresh worker."""
    r = Repl(lambda name, args, kwargs: {"tool": name, "args": args}, ["peek_examples"],
             RLMOptConfig(block_timeout_s=1.5))
    r.start()
    try:
        res = _run_guarded(r, _FORGE.format(n=100, per_write=1))
        assert res.killed and "1.5 s with tool results it did not read" in res.killed, res
        assert "\n" not in res.killed
        assert r.run("1 + 1").output.strip() == "2"
    finally:
        r.close()


def test_the_deadline_is_checked_before_each_buffered_tool_call():
    """40 forged calls of a 0.2 s tool arrive in one write (so all are buffered at once): the
    harness serves at most those that start within the 1 s cap (5, plus the one under way), not
    all 40."""
    calls = []

    def slow(name, args, kwargs):
        calls.append(name)
        time.sleep(0.2)
        return "ok"
    r = Repl(slow, ["peek_examples"], RLMOptConfig(block_timeout_s=1.0))
    r.start()
    try:
        res = _run_guarded(r, _FORGE.format(n=1, per_write=40).replace('"p" * 4096', '"p"'))
        assert res.killed and "ran past 1 s" in res.killed, res
        assert 1 <= len(calls) <= 6, len(calls)
    finally:
        r.close()


# -- the sandbox fails closed (issue #49) -----------------------------------------------------------

@pytest.mark.parametrize("root", [True, False])
@pytest.mark.parametrize("layer", layers.LAYERS)
def test_a_report_without_a_promised_layer_is_refused(layer, root):
    """The refusal rule on fabricated reports: each layer missing (or left out of the report)
    refuses a strict REPL with one line naming it and the opt-in, except `user` for a harness that
    is not root (not promised there); best_effort never refuses."""
    holds = dict.fromkeys(layers.LAYERS, True)
    assert layers.refusal(holds, {}, root=root, mode="strict") is None
    for report in ({**holds, layer: False}, {k: v for k, v in holds.items() if k != layer}):
        why = layers.refusal(report, {layer: "simulated"}, root=root, mode="strict")
        if layer == "user" and not root:
            assert why is None
            continue
        assert why and f"{layer} (" in why and "--sandbox=best_effort" in why and "\n" not in why
        assert [k for k in layers.LAYERS if f"{k} (" in why] == [layer]
        assert layers.refusal(report, {}, root=root, mode="best_effort") is None
    with pytest.raises(ValueError, match="sandbox mode 'lax'"):
        layers.refusal(holds, {}, root=root, mode="lax")


# A worker started under a seccomp filter that makes the system calls one layer is built from fail,
# as they fail on a host without that layer (no Landlock in the kernel, no seccomp, a root without
# CAP_SETUID ...). The filter is the test's own launcher; the worker and the Repl are unchanged.
_EPERM, _ENOSYS, _EINVAL = errno.EPERM, errno.ENOSYS, errno.EINVAL
_NE, _EQ = 1, 4  # SCMP_CMP_NE, SCMP_CMP_EQ
_TAKE_AWAY = {
    "rlimits": [("setrlimit", _EPERM, []), ("prlimit64", _EPERM, [(2, _NE, 0, 0)])],
    "capabilities": [("capset", _EPERM, [])],
    "user": [("setgroups", _EPERM, []), ("setresgid", _EPERM, []), ("setresuid", _EPERM, [])],
    "landlock": [("landlock_create_ruleset", _ENOSYS, [])],
    "seccomp": [("seccomp", _ENOSYS, []), ("prctl", _EINVAL, [(0, _EQ, 22, 0)])],  # SET_SECCOMP
}
_LAUNCHER = textwrap.dedent("""\
    import ctypes, json, os, sys
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                    ("b", ctypes.c_uint64)]
    ctx = lib.seccomp_init(0x7FFF0000)  # allow everything else
    for name, err, cmps in json.loads(sys.argv[1]):
        arr = (Cmp * len(cmps))(*[Cmp(*c) for c in cmps]) if cmps else None
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if lib.seccomp_rule_add_array(ctx, 0x00050000 | err, nr, len(cmps), arr) != 0:
            sys.exit(f"rule for {name} refused")
    if lib.seccomp_load(ctx) != 0:
        sys.exit("seccomp_load failed")
    os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[2], sys.argv[3]])""")


def _has_libseccomp() -> bool:
    try:
        ctypes.CDLL("libseccomp.so.2")
        return True
    except OSError:
        return False


class _DeprivedRepl(Repl):
    """A Repl whose worker starts where the system calls of `layer` fail."""

    def __init__(self, layer: str, config: RLMOptConfig):
        super().__init__(lambda name, args, kwargs: "ok", ["peek_examples"], config)
        self.deny = _TAKE_AWAY[layer]

    def _command(self, config_json: str) -> list[str]:
        return [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(self.deny), str(WORKER),
                config_json]


@pytest.mark.skipif(not _has_libseccomp(), reason="the launcher takes layers away with libseccomp")
@pytest.mark.parametrize("layer", layers.LAYERS)
def test_a_worker_without_a_promised_layer_runs_no_agent_code(layer):
    """A worker whose host cannot build `layer`: a strict REPL refuses to start with one line
    naming it (and leaves no worker behind); best_effort starts, runs code and reports the layer
    missing. `user` is promised only to a harness running as root."""
    promised = layer != "user" or os.geteuid() == 0  # the rule of docs/rlmopt.md, Sandbox
    r = _DeprivedRepl(layer, RLMOptConfig(block_timeout_s=5))
    try:
        if promised:
            with pytest.raises(layers.SandboxRefused) as refused:
                r.start()
            why = str(refused.value)
            assert f"{layer} (" in why and "--sandbox=best_effort" in why and "\n" not in why, why
            assert r.proc is None and r.dir is None
        else:
            r.start()
            assert r.holds[layer] is False and r.run("1 + 1").output.strip() == "2"
    finally:
        r.close()
    lax = _DeprivedRepl(layer, RLMOptConfig(block_timeout_s=5, sandbox="best_effort"))
    lax.start()
    try:
        assert lax.holds[layer] is False, lax.lockdown_errors
        assert {k for k, v in lax.holds.items() if not v} <= {layer, "user"}  # user: not root
        report = lax.sandbox_report()
        assert report["mode"] == "best_effort" and layer in report["missing"]
        assert layer not in report["in_force"]
        assert f"{layer} (" in layers.log_line(report).split("; missing ", 1)[1]
        assert lax.run("1 + 1").output.strip() == "2"
    finally:
        lax.close()


@pytest.mark.skipif(not _has_libseccomp(), reason="the launcher takes layers away with libseccomp")
def test_a_strict_run_refuses_before_the_seed_spends_any_task_lm_call(tmp_path, monkeypatch):
    """rlmopt.run with a promised layer missing: refused in one line before the seed's validation
    pass (it used to spend a whole pass of task-LM calls first: real money with a paid LM)."""
    import asyncio

    from rlmopt.lm import FunctionLM, ScriptedLM
    from rlmopt.pipeline import optimise
    from tests.rlmopt_fakes import _toy_reply, toy_task

    deny = _TAKE_AWAY["seccomp"]
    monkeypatch.setattr(Repl, "_command", lambda self, cfg: [sys.executable, "-I", "-S", "-c", _LAUNCHER,
                                                             json.dumps(deny), str(WORKER), cfg])
    calls = []
    task_lm = FunctionLM(lambda prompt: calls.append(1) or _toy_reply(prompt))
    with pytest.raises(layers.SandboxRefused) as refused:
        asyncio.run(optimise(toy_task(), RLMOptConfig(budget=10, block_timeout_s=5), method="rlmopt",
                             task_lm=task_lm, optimizer_lm=ScriptedLM(["x"]), sub_lm=None, judge_lm=None,
                             run_dir=tmp_path / "run", names={"task": "toy", "optimizer": "scripted"},
                             log=lambda s: None))
    assert "seccomp (" in str(refused.value) and "\n" not in str(refused.value)
    assert calls == [] and not (tmp_path / "run").exists()
