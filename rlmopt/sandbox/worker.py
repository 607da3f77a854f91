"""The REPL worker: a standalone stdlib-only script, started as `python -I -S worker.py CONFIG`
in its own empty directory by `rlmopt.sandbox.repl.Repl`.

At start it pre-imports the modules agent code may use, then locks itself down in this order
(each step is reported in the `ready` message, so the parent knows what holds):
- rlimits: address space, CPU seconds, open files, file size, processes (hard = soft; no
  processes also means no threads for a non-root user);
- capabilities and user (two layers in the report): started as root, it hands its directory to
  the unprivileged user `_NOBODY`, drops every capability from the bounding set, clears the
  ambient set, switches all user and group ids (which empties the permitted and effective sets),
  empties the inheritable set and sets no_new_privs (whoever started it: the capability layer
  holds for a non-root start too; the user layer then reports that there was none to switch). Imports
  then go through directory descriptors opened while still root (`/proc/self/fd/N`), so the
  standard library stays importable even where its path is closed to other users (/root);
- Landlock (Linux >= 5.13), at the highest ABI the kernel offers: read-only access to the Python
  stdlib and system library directories, read-write to its own directory, nothing else on the
  filesystem (ABI 3 adds truncate, ABI 5 device ioctls, ABI 4 TCP, ABI 6 signals and abstract
  sockets outside the sandbox);
- seccomp (through libseccomp.so.2 via ctypes): an allowlist (`_ALLOWED` plus argument-checked
  rules); every other system call fails with EPERM.
Then it serves newline-delimited JSON on its original stdin/stdout: {"op": "exec", "code",
"nonce"} runs code in one persistent namespace and answers {"op": "done", "output", "error",
"nonce"}; while code runs, each tool call is sent as {"op": "tool", "id", "name", "args", "kwargs"}
and blocks until the parent answers {"op": "result", "id", "value"} (results for other ids are
dropped). File descriptors 0-2 are pointed at /dev/null, so raw writes from agent code cannot
reach the channel by accident.
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

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_NOBODY = 65534  # the conventional unprivileged user and group

# -- privileges ----------------------------------------------------------------------------------

_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAP_VERSION_3 = 0x20080522


def _capset_empty():
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (two 32-bit words each)
    return _LIBC.capset(header, data) == 0


def _capabilities():
    """{"CapInh": int, "CapPrm": ..., "CapEff", "CapBnd", "CapAmb"} of this process."""
    with open("/proc/self/status") as fh:
        return {k: int(v, 16) for k, v in (line.split(":\t") for line in fh)
                if k.startswith("Cap")}


def _drop_privileges(here):
    """Drops every capability and sets no_new_privs; started as root, also hands `here` to
    _NOBODY and becomes it. (capabilities, user): None for each layer that holds, else what
    failed (for a non-root start, `user` says there was no user to switch from)."""
    root = os.geteuid() == 0
    caps = user = None
    if root:
        try:
            os.chown(here, _NOBODY, _NOBODY)
        except OSError as exc:
            user = f"handing its directory to user {_NOBODY} failed: {exc}"
        for cap in range(64):  # until EINVAL: past the kernel's last capability
            if _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break
    _LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if not root:
        user = f"not started as root (uid {os.getuid()}): no user to switch from"
    elif user is None:
        try:
            os.setgroups([])
            os.setresgid(_NOBODY, _NOBODY, _NOBODY)
            os.setresuid(_NOBODY, _NOBODY, _NOBODY)
        except OSError as exc:
            user = f"switching to user {_NOBODY} failed: {exc}"
    if not _capset_empty():
        caps = f"capset failed (errno {ctypes.get_errno()})"
    elif _LIBC.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: Landlock and seccomp need it
        caps = "prctl(PR_SET_NO_NEW_PRIVS) failed"
    else:
        try:  # a non-root start keeps a full bounding set, which matters only for exec
            left = {k: hex(v) for k, v in _capabilities().items() if v and (k != "CapBnd" or root)}
        except OSError as exc:
            left = {"/proc/self/status": str(exc)}
        if left:
            caps = f"capabilities left: {left}"
    if user is None and 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
        user = f"still uid {os.getuid()} gid {os.getgid()}"
    return caps, user


def _imports_through_descriptors():
    """Points sys.path, and the search paths of packages already imported (`encodings` looks up
    codecs lazily), at descriptors of their directories, opened now (still root)."""
    moved = {}
    for path in sys.path:
        if os.path.isdir(path):
            moved[path] = f"/proc/self/fd/{os.open(path, os.O_PATH | os.O_DIRECTORY)}"

    def through(path):
        for real, fd_path in moved.items():
            if path == real or path.startswith(real + os.sep):
                return fd_path + path[len(real):]
        return path

    sys.path[:] = list(moved.values())
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [through(p) for p in search]
    sys.path_importer_cache.clear()


# -- Landlock ------------------------------------------------------------------------------------

_LL_EXECUTE, _LL_WRITE, _LL_READ_FILE, _LL_READ_DIR = 1, 2, 4, 8
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LL_NET_TCP = 1 | 2  # bind, connect
_LL_SCOPE = 1 | 2  # abstract unix sockets, signals
_SYS_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock_ruleset(read_paths, write_paths, info):
    """A ruleset descriptor (built while the paths can still be opened, before the privilege
    drop), or what failed (a string)."""
    machine = os.uname().machine
    if machine not in _SYS_LANDLOCK:
        return f"unsupported machine {machine}"
    create, add, _ = _SYS_LANDLOCK[machine]
    abi = _LIBC.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._VERSION
    if abi < 1:
        return f"Landlock is not available (errno {ctypes.get_errno()})"
    info["landlock_abi"] = abi
    fs = ((1 << 13) - 1) | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) \
        | (_LL_IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(fs, _LL_NET_TCP if abi >= 4 else 0, _LL_SCOPE if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as this ABI knows it
    fd = _LIBC.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return f"landlock_create_ruleset failed (errno {ctypes.get_errno()})"
    file_rights = _LL_EXECUTE | _LL_WRITE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV
    read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    for paths, access in ((read_paths, read), (write_paths, fs)):
        for path in paths:
            if not os.path.exists(path):
                continue
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rights = access if os.path.isdir(path) else access & file_rights & fs
            rule = _PathBeneath(rights, pfd)
            rc = _LIBC.syscall(add, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule),
                               ctypes.c_uint32(0))
            os.close(pfd)
            if rc < 0:
                return f"landlock_add_rule({path}) failed (errno {ctypes.get_errno()})"
    return fd


def _landlock_restrict(ruleset):
    """Applies the ruleset of _landlock_ruleset to this process. None, or what failed."""
    if isinstance(ruleset, str):
        return ruleset
    if _LIBC.prctl(39, 0, 0, 0, 0) != 1 and _LIBC.prctl(38, 1, 0, 0, 0) != 0:  # NO_NEW_PRIVS
        return "prctl(PR_SET_NO_NEW_PRIVS) failed"
    restrict = _SYS_LANDLOCK[os.uname().machine][2]
    if _LIBC.syscall(restrict, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        return f"landlock_restrict_self failed (errno {ctypes.get_errno()})"
    os.close(ruleset)
    return None


# -- seccomp -------------------------------------------------------------------------------------

class _Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]


_CMP_EQ, _CMP_MASKED_EQ = 4, 7
_ACT_ALLOW, _ACT_ERRNO = 0x7FFF0000, 0x00050000
# What CPython and its standard library need for computing, threads, and files (which Landlock
# confines). Left out on purpose, among others: sockets, exec, fork, signals to others (pidfd_*,
# rt_*sigqueueinfo, tkill), chmod/chown/utime and xattrs (Landlock does not cover them), mknod,
# memfd, SysV and POSIX IPC, ptrace, mount and namespaces, io_uring, bpf, perf, keys, modules,
# reboot/kexec, clock and host name setters, swap, setuid/setgid, setsid/setpgid, priorities.
_ALLOWED = """
read write readv writev pread64 pwrite64 preadv preadv2 pwritev pwritev2 lseek close close_range
open openat openat2 creat stat fstat lstat newfstatat statx statfs fstatfs access faccessat
faccessat2 readlink readlinkat getcwd chdir fchdir getdents getdents64 mkdir mkdirat rmdir unlink
unlinkat rename renameat renameat2 link linkat symlink symlinkat truncate ftruncate fsync fdatasync
flock dup dup2 dup3 pipe pipe2 fadvise64 sendfile copy_file_range
mmap munmap mprotect mremap madvise brk msync mincore
futex set_robust_list rseq set_tid_address exit exit_group restart_syscall
rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigsuspend sigaltstack
getpid gettid getppid getuid geteuid getgid getegid getgroups getresuid getresgid getpgrp getpgid
getsid capget sched_yield sched_getaffinity sched_getparam sched_getscheduler
sched_get_priority_max sched_get_priority_min getcpu
nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time getitimer setitimer alarm
timer_create timer_settime timer_gettime timer_getoverrun timer_delete
timerfd_create timerfd_settime timerfd_gettime
getrandom uname sysinfo getrlimit getrusage times umask arch_prctl map_shadow_stack
select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
eventfd eventfd2
""".split()
_FCNTL_CMDS = (0, 1, 2, 3, 4, 5, 6, 7, 36, 37, 38, 1030, 1031, 1032, 1033, 1034)  # no F_SETOWN/SIG
_IOCTL_CMDS = (0x5401, 0x541B, 0x5421, 0x5450, 0x5451)  # TCGETS FIONREAD FIONBIO FIONCLEX FIOCLEX
_PRCTL_OPTIONS = (15, 16, 21, 23, 39)  # PR_SET/GET_NAME, GET_SECCOMP, CAPBSET_READ, GET_NO_NEW_PRIVS
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 \
    | 0x00020000  # NEWCGROUP UTS IPC USER PID NET, NEWNS


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
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ACT_ERRNO | 1)  # EPERM for everything not allowed below
    if not ctx:
        return "seccomp_init failed"
    pid = os.getpid()

    def rule(name, action=_ACT_ALLOW, cmps=()):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall on this architecture
            return
        arr = (_Cmp * len(cmps))(*cmps) if cmps else None
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}")

    try:
        for name in _ALLOWED:
            rule(name)
        rule("clone3", _ACT_ERRNO | 38)  # ENOSYS: libc falls back to clone, checked below
        rule("clone", cmps=[_Cmp(0, _CMP_MASKED_EQ, _CLONE_THREAD | _CLONE_NAMESPACES,
                                 _CLONE_THREAD)])  # a thread, never a process or a namespace
        rule("kill", cmps=[_Cmp(0, _CMP_EQ, pid, 0)])
        rule("tgkill", cmps=[_Cmp(0, _CMP_EQ, pid, 0)])
        for who in (0, pid):  # reading its own limits; setting any fails
            rule("prlimit64", cmps=[_Cmp(0, _CMP_EQ, who, 0), _Cmp(2, _CMP_EQ, 0, 0)])
        for cmd in _FCNTL_CMDS:
            rule("fcntl", cmps=[_Cmp(1, _CMP_EQ, cmd, 0)])
        for cmd in _IOCTL_CMDS:
            rule("ioctl", cmps=[_Cmp(1, _CMP_EQ, cmd, 0)])
        for option in _PRCTL_OPTIONS:
            rule("prctl", cmps=[_Cmp(0, _CMP_EQ, option, 0)])
        rule("prctl", cmps=[_Cmp(0, _CMP_EQ, 47, 0), _Cmp(1, _CMP_EQ, 1, 0)])  # AMBIENT_IS_SET
    except OSError as exc:
        lib.seccomp_release(ctx)
        return str(exc)
    rc = lib.seccomp_load(ctx)
    lib.seccomp_release(ctx)
    return None if rc == 0 else f"seccomp_load failed ({rc})"


def _rlimits(cfg):
    limits = {"RLIMIT_AS": cfg["memory_mb"] << 20, "RLIMIT_CPU": cfg["cpu_s"],
              "RLIMIT_NOFILE": cfg["files"], "RLIMIT_FSIZE": cfg["file_mb"] << 20,
              "RLIMIT_NPROC": 0}
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


# -- serving -------------------------------------------------------------------------------------

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
        while True:  # answers to calls forged on the channel by agent code are not ours
            msg = self.recv()
            if msg.get("op") == "result" and msg.get("id") == self.next_id:
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
    status = {"rlimits": None, "capabilities": None, "user": None, "landlock": None,
              "seccomp": None}
    info = {"landlock_abi": 0}
    try:
        _rlimits(cfg)
    except (OSError, ValueError) as exc:
        status["rlimits"] = str(exc)
    here = os.getcwd()
    reads = [p for p in sys.path if p] + ["/usr", "/lib", "/lib64", "/dev/null", "/dev/urandom"]
    ruleset = _landlock_ruleset(reads, [here], info)
    if os.geteuid() == 0:
        _imports_through_descriptors()
    status["capabilities"], status["user"] = _drop_privileges(here)
    info["uid"] = os.getuid()
    status["landlock"] = _landlock_restrict(ruleset)
    status["seccomp"] = _seccomp()
    chan.send({"op": "ready", "pid": os.getpid(), "dir": here, "info": info,
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
        chan.send({"op": "done", "output": out.text(), "error": error, "nonce": msg.get("nonce")})


if __name__ == "__main__":
    main()
