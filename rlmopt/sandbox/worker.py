"""The REPL worker: a standalone stdlib-only script, started as `python -I -S worker.py CONFIG`
in its own empty directory by `rlmopt.sandbox.repl.Repl`.

At start it pre-imports the modules agent code may use, then locks itself down (each step is
reported in the `ready` message, so the parent knows what holds):
- rlimits: address space, CPU seconds, open files, file size, processes (hard = soft);
- Landlock (Linux >= 5.13): read-only access to the Python stdlib and system library
  directories, read-write to its own directory, nothing else on the filesystem;
- seccomp (through libseccomp.so.2 via ctypes): no sockets, no exec, no fork or non-thread clone,
  no signals to other processes, no rlimit changes, no ptrace/mount/namespaces/io_uring/bpf.
Then it serves newline-delimited JSON on its original stdin/stdout: {"op": "exec", "code"} runs
code in one persistent namespace and answers {"op": "done", "output", "error"}; while code runs,
each tool call is sent as {"op": "tool", "id", "name", "args", "kwargs"} and blocks until the
parent answers {"op": "result", "id", "value"}. File descriptors 0-2 are pointed at /dev/null, so
raw writes from agent code cannot reach the channel by accident.
"""
import ast
import collections  # noqa: F401  (pre-imported for agent code: imports after lockdown may fail)
import contextlib
import ctypes
import ctypes.util  # noqa: F401
import functools  # noqa: F401
import io
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import signal
import statistics  # noqa: F401
import string  # noqa: F401
import sys
import textwrap  # noqa: F401
import traceback

# Landlock ABI 1 filesystem rights (linux/landlock.h).
_LL_EXECUTE, _LL_WRITE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_ALL_V1 = (1 << 13) - 1
_SYS_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(read_paths, write_paths):
    machine = os.uname().machine
    if machine not in _SYS_LANDLOCK:
        return f"unsupported machine {machine}"
    create, add, restrict = _SYS_LANDLOCK[machine]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = ctypes.c_uint64(_LL_ALL_V1)
    fd = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if fd < 0:
        return f"landlock_create_ruleset failed (errno {ctypes.get_errno()})"
    read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    for paths, access in ((read_paths, read), (write_paths, _LL_ALL_V1)):
        for path in paths:
            if not os.path.exists(path):
                continue
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rights = access if os.path.isdir(path) else access & (_LL_EXECUTE | _LL_WRITE | _LL_READ_FILE)
            rule = _PathBeneath(rights, pfd)
            rc = libc.syscall(add, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
            os.close(pfd)
            if rc < 0:
                return f"landlock_add_rule({path}) failed (errno {ctypes.get_errno()})"
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return "prctl(PR_SET_NO_NEW_PRIVS) failed"
    if libc.syscall(restrict, ctypes.c_int(fd), ctypes.c_uint32(0)) < 0:
        return f"landlock_restrict_self failed (errno {ctypes.get_errno()})"
    os.close(fd)
    return None


class _Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]


_CMP_NE, _CMP_MASKED_EQ = 1, 7
_CLONE_THREAD = 0x00010000
_DENIED = ("socket", "socketpair", "execve", "execveat", "fork", "vfork", "tkill", "ptrace",
           "process_vm_readv", "process_vm_writev", "setrlimit", "mount", "umount2",
           "unshare", "setns", "chroot", "pivot_root", "io_uring_setup", "bpf", "perf_event_open",
           "keyctl", "add_key", "request_key", "personality", "userfaultfd")


def _seccomp():
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "libseccomp.so.2 not found"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW by default
    if not ctx:
        return "seccomp_init failed"
    pid = os.getpid()

    def deny(name, errno=1, cmps=()):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall on this architecture
            return
        arr = (_Cmp * len(cmps))(*cmps) if cmps else None
        rc = lib.seccomp_rule_add_array(ctx, 0x00050000 | errno, nr, len(cmps), arr)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}")

    try:
        for name in _DENIED:
            deny(name)
        deny("clone3", errno=38)  # ENOSYS: libc falls back to clone, filtered below
        deny("clone", cmps=[_Cmp(0, _CMP_MASKED_EQ, _CLONE_THREAD, 0)])  # a process, not a thread
        deny("prlimit64", cmps=[_Cmp(2, _CMP_NE, 0, 0)])  # reading limits stays allowed
        deny("kill", cmps=[_Cmp(0, _CMP_NE, pid, 0)])
        deny("tgkill", cmps=[_Cmp(0, _CMP_NE, pid, 0)])
    except OSError as exc:
        return str(exc)
    if lib.seccomp_load(ctx) != 0:
        return "seccomp_load failed"
    return None


def _rlimits(cfg):
    limits = {"RLIMIT_AS": cfg["memory_mb"] << 20, "RLIMIT_CPU": cfg["cpu_s"],
              "RLIMIT_NOFILE": cfg["files"], "RLIMIT_FSIZE": cfg["file_mb"] << 20,
              "RLIMIT_NPROC": 0}
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


class _CappedWriter(io.TextIOBase):
    def __init__(self, cap):
        self.parts, self.size, self.cap, self.dropped = [], 0, cap, 0

    def write(self, s):
        s = str(s)
        room = self.cap - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self):
        out = "".join(self.parts)
        return out + (f"\n... [{self.dropped} more characters not kept]" if self.dropped else "")


class _Channel:
    def __init__(self, rfd, wfd):
        self.r = os.fdopen(rfd, "r", encoding="utf-8")
        self.w = os.fdopen(wfd, "w", encoding="utf-8")
        self.next_id = 0

    def send(self, msg):
        self.w.write(json.dumps(msg) + "\n")
        self.w.flush()

    def recv(self):
        line = self.r.readline()
        if not line:
            raise SystemExit(0)
        return json.loads(line)

    def call(self, name, args, kwargs):
        self.next_id += 1
        self.send({"op": "tool", "id": self.next_id, "name": name, "args": list(args),
                   "kwargs": kwargs})
        msg = self.recv()
        return msg.get("value")


def _run(code, namespace):
    tree = ast.parse(code, "<block>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<block>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<block>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def main():
    cfg = json.loads(sys.argv[1])
    chan = _Channel(os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails, it does not kill
    status = {"rlimits": None, "landlock": None, "seccomp": None}
    try:
        _rlimits(cfg)
    except (OSError, ValueError) as exc:
        status["rlimits"] = str(exc)
    here = os.getcwd()
    reads = [p for p in sys.path if p] + ["/usr", "/lib", "/lib64", "/dev/null", "/dev/urandom"]
    status["landlock"] = _landlock(reads, [here])
    status["seccomp"] = _seccomp()
    chan.send({"op": "ready", "pid": os.getpid(), "dir": here,
               "holds": {k: v is None for k, v in status.items()},
               "errors": {k: v for k, v in status.items() if v}})
    namespace = {"__name__": "__repl__"}
    for name in cfg["tools"]:
        namespace[name] = (lambda n: lambda *a, **k: chan.call(n, a, k))(name)
    namespace["FINAL"] = namespace.get("final")
    while True:
        msg = chan.recv()
        if msg.get("op") != "exec":
            continue
        out = _CappedWriter(cfg["output_cap"])
        error = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                _run(msg["code"], namespace)
            except SystemExit:
                error = "SystemExit is ignored in the REPL"
            except BaseException:  # report everything, including MemoryError, and keep serving
                error = traceback.format_exc(limit=-3)
        chan.send({"op": "done", "output": out.text(), "error": error})


if __name__ == "__main__":
    main()
