"""The sandbox's runner script: ``python -I -S -B -X utf8 sandbox_runner.py WORKDIR``.

Started by `oxrl_rewards.sandbox` (read that module's docstring for the whole design) as the
trainer's user, in a fresh session, with a clean environment, the program's stdin/stdout/stderr
already redirected to files, and the results file open on ``spec["result_fd"]``. It is not
imported by the trainer. In order, before any untrusted code runs, it:

1. reads ``spec.json`` (then deletes it: it holds the nonce) and ``main.py`` (the program);
2. lowers its resource limits (CPU seconds, address space, file size, open files, core dumps) and
   asks for SIGKILL when the trainer dies (PR_SET_PDEATHSIG);
3. ``mode == "root"``: unshares mount + net + pid + ipc namespaces, forks (the child is PID 1 of
   the new pid namespace), builds a minimal root on a tmpfs (read-only binds of /usr, /bin, /lib*,
   the Python stdlib; four /dev nodes; its own /proc; an empty /tmp and /sandbox), chroots into it
   and drops to the run's private uid/gid with no supplementary groups (which clears every
   capability) and sets RLIMIT_NPROC for that uid;
   ``mode == "userns"`` (not root): the same without the new root, inside a new user namespace;
   the child mounts its own /proc, then drops all capabilities;
   both: the child sets PR_SET_PDEATHSIG (it dies with the runner) once its credentials are final
   (a uid change clears it), then checks, through a pipe, that the runner is still there;
   ``mode == "none"``: a root trainer's capabilities are dropped (uid 0 stays);
   all: PR_SET_NO_NEW_PRIVS (no setuid binary can raise privileges again); ctypes is unloaded;
4. installs the Python guard (`install_guard`, an audit hook) unless ``spec["guard"]`` is false;
5. reports ``ready``, then runs the program as ``__main__`` and, in the same namespace, each test
   statement, writing one line per test to the results file; every line starts with the nonce.

The parent process of the namespaced child (this script before the fork) only waits for it and
exits with its status (128 + signal number when it was killed).
"""

from __future__ import annotations

import json
import os
import select
import sys

EXIT_SANDBOX = 3  # the sandbox itself could not be set up; nothing of the program ran

# <linux/sched.h>, <linux/mount.h>, <linux/prctl.h>
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x8000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")
SANDBOX_DIR = "/sandbox"  # the program's working directory inside the new root


def main(workdir: str) -> None:
    with open(os.path.join(workdir, "spec.json"), encoding="utf-8") as handle:
        spec = json.load(handle)
    os.remove(os.path.join(workdir, "spec.json"))
    with open(os.path.join(workdir, "main.py"), encoding="utf-8", errors="replace") as handle:
        source = handle.read()
    report = reporter(spec["result_fd"], spec["nonce"])
    stdlib = [path for path in sys.path if os.path.exists(path)]
    try:
        set_limits(spec["limits"])
        workdir = isolate(spec, stdlib)
        os.chdir(workdir)
        workdir = os.getcwd()  # canonical, as the guard compares it with getcwd()-based paths
    except Exception as exc:  # noqa: BLE001 - any setup failure: fail closed, run nothing
        report(f"sandbox {type(exc).__name__}: {exc}")
        os._exit(EXIT_SANDBOX)
    import linecache
    import traceback
    import types

    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    report("ready")
    if spec["guard"]:
        install_guard(workdir, stdlib)
    program = Program(source, report, traceback, types)
    code = program.run_tests(spec["tests"]) if spec["tests"] is not None else program.run_io()
    os._exit(code)


def reporter(fd: int, nonce: str):
    """``report(line)`` appends ``"<nonce> <line>"`` to the results file (the program cannot forge the nonce
    without digging through the runner's frames; see the limits in `oxrl_rewards.sandbox`)."""
    write = os.write  # bound now: the program may monkeypatch os.write later

    def report(line: str) -> None:
        write(fd, f"{nonce} {line}\n".encode("utf-8", "replace"))

    return report


def set_limits(limits: dict) -> None:
    """Lower soft and hard limits together, so the program cannot raise them again."""
    import resource

    def cap(which: int, soft: int, hard: int | None = None) -> None:
        resource.setrlimit(which, (soft, soft if hard is None else hard))

    cap(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # SIGXCPU at the soft limit, SIGKILL 1 s later
    cap(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    cap(resource.RLIMIT_FSIZE, limits["output_bytes"])  # stdout, stderr and any file the program writes
    cap(resource.RLIMIT_NOFILE, limits["max_open_files"])
    cap(resource.RLIMIT_CORE, 0)


# ----------------------------------------------------------------------------- privileges and namespaces


def isolate(spec: dict, stdlib: list[str]) -> str:
    """SIGKILL when the trainer dies (PR_SET_PDEATHSIG); modes ``root``/``userns``: enter the namespaces
    (only the child returns); mode ``none``: drop the capabilities of a root trainer. Then
    PR_SET_NO_NEW_PRIVS. Returns the program's working directory."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PDEATHSIG)")  # die with the trainer
    if os.getppid() != spec["parent"]:
        raise OSError("the trainer exited before the runner started")
    if spec["mode"] == "none":
        workdir = spec["workdir"]
        if os.geteuid() == 0:  # uid 0 stays (root's own files are the guard's job); mknod, mount, ptrace, ... go
            drop_capabilities(check)
    else:
        workdir = enter_namespaces(spec, stdlib, libc, check)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    del libc
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]  # re-importing it is refused by the guard
    return workdir


def enter_namespaces(spec: dict, stdlib: list[str], libc, check) -> str:
    import ctypes
    import resource

    def mount(source, target, fstype, flags: int, data=None) -> None:
        encode = lambda s: None if s is None else os.fsencode(s)
        check(
            libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
            f"mount {target}",
        )

    root = spec["mode"] == "root"
    uid, gid = os.getuid(), os.getgid()
    check(
        libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (0 if root else CLONE_NEWUSER)),
        "unshare",
    )
    if not root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        # In a user namespace RLIMIT_NPROC counts that namespace's processes only (Linux >= 5.14).
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["limits"]["max_processes"],) * 2)
    runner_alive, keep_open = os.pipe()  # the runner never writes: EOF here means it has exited
    child = os.fork()
    if child:
        os.close(runner_alive)
        supervise(child)
    os.close(keep_open)
    # From here on: PID 1 of the new pid namespace. When it exits, the kernel kills every other
    # process in the namespace (a forked child that called setsid() included).
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if root:
        workdir = build_root(spec, stdlib, mount)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["limits"]["max_processes"],) * 2)
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])  # from root to another uid: every capability is gone
    else:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        drop_capabilities(check)
        workdir = spec["workdir"]
    # Die with the runner. Set only now: a change of uid clears it. If the runner died already, stop.
    check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PDEATHSIG)")
    if select.select([runner_alive], [], [], 0)[0]:
        raise OSError("the runner exited during setup")
    os.close(runner_alive)
    return workdir


def supervise(child: int) -> None:
    """The runner outside the pid namespace: wait for its PID 1 and exit with its status."""
    _, status = os.waitpid(child, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def build_root(spec: dict, stdlib: list[str], mount) -> str:
    """A minimal root on a tmpfs: read-only system dirs and stdlib, /dev nodes, own /proc, /tmp, /sandbox."""
    os.umask(0o022)
    new = os.path.join(spec["workdir"], "root")
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['scratch_mb']}m,mode=0755")
    bound: list[str] = []
    for path in (*SYSTEM_DIRS, *stdlib):
        if not os.path.exists(path) or any(path == b or path.startswith(b + "/") for b in bound):
            continue
        target = new + path
        if os.path.islink(path) and path.count("/") == 1:  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        mount(path, target, None, MS_BIND | MS_REC)
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        bound.append(path)
    os.mkdir(new + "/dev")
    for name in DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{new}/dev/{name}")
    os.mkdir(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + "/tmp")
    os.chmod(new + "/tmp", 0o1777)
    os.mkdir(new + SANDBOX_DIR, 0o700)
    os.chown(new + SANDBOX_DIR, spec["uid"], spec["uid"])
    os.chroot(new)
    return SANDBOX_DIR


def drop_capabilities(check) -> None:
    """capset(2) with empty effective, permitted and inheritable sets."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    check(ctypes.CDLL(None, use_errno=True).capset(ctypes.byref(header), data), "capset")


# ----------------------------------------------------------------------------- the Python guard


def install_guard(workdir: str, stdlib: list[str]) -> None:
    """An audit hook (PEP 578) that refuses process creation, signals to other processes, sockets
    (except unconnected AF_UNIX pairs), ctypes, resource limits, gc's object
    walks, symlinks/hard links, chdir, writes outside ``workdir`` and reads outside ``workdir``, the
    stdlib and a few /dev files. It cannot be removed; everything it calls is bound here, so a
    program that monkeypatches builtins or os cannot change what it checks."""
    import posix
    from _stat import S_ISDIR

    _type, _isinstance, _str, _bytes, _int, _error = type, isinstance, str, bytes, int, PermissionError
    stat, getcwd = posix.stat, posix.getcwd
    encoding = sys.getfilesystemencoding()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    o_directory = os.O_DIRECTORY
    af_unix = 1
    readable_roots = (workdir, *stdlib, "/usr/share/zoneinfo")
    readable_files = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdin", "/etc/localtime")
    writable_files = ("/dev/null", "/dev/stdout", "/dev/stderr")
    denied = frozenset(
        {
            "os.system",
            "os.exec",
            "os.fork",
            "os.forkpty",
            "os.posix_spawn",
            "os.spawn",
            "subprocess.Popen",
            "os.kill",
            "os.killpg",
            "os.chdir",
            "os.link",
            "os.symlink",
            "os.setxattr",
            "os.removexattr",
            "resource.setrlimit",
            "resource.prlimit",
            "gc.get_objects",
            "gc.get_referrers",
            "gc.get_referents",
        }
    )
    denied_prefixes = ("socket.", "ctypes.", "syslog.")
    denied_modules = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})
    # event -> positions of the path arguments that are written (else read)
    writes = {
        "os.remove": (0,),
        "os.rmdir": (0,),
        "os.mkdir": (0,),
        "os.rename": (0, 1),
        "os.chmod": (0,),
        "os.chown": (0,),
        "os.utime": (0,),
        "os.truncate": (0,),
        "os.chflags": (0,),
        "os.lchflags": (0,),
        "shutil.rmtree": (0,),
    }
    reads = frozenset({"os.listdir", "os.scandir", "os.fwalk", "glob.glob", "os.listxattr", "os.getxattr"})

    def refuse(what: str):
        raise _error(f"sandbox: {what} is not allowed")

    def absolute(path) -> str:
        """The lexically normalised absolute path (no symlink can be created, so none is followed)."""
        if path is None:
            path = "."
        if _type(path) is _bytes:
            path = _bytes.decode(path, encoding, "surrogateescape")
        elif _type(path) is not _str:
            refuse(f"a path of type {_type(path).__name__}")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts: list[str] = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def under(path: str, roots: tuple) -> bool:
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return True
        return False

    def check_write(path) -> None:
        if _type(path) is _int:
            return  # an fd: opening it was checked
        full = absolute(path)
        if not (under(full, (workdir,)) or full in writable_files):
            refuse(f"writing {full}")

    def check_read(path, open_flags: int | None = None) -> None:
        if _type(path) is _int:
            return
        full = absolute(path)
        if under(full, (workdir,)):
            return
        if full in readable_files:
            return
        if not under(full, readable_roots) or "/site-packages" in full or "/dist-packages" in full:
            refuse(f"reading {full}")
        if open_flags is None:
            return
        # No directory fds outside workdir: *at() calls (dir_fd=) would escape the path check.
        try:
            is_dir = open_flags & o_directory or S_ISDIR(stat(full).st_mode)
        except OSError:
            return
        if is_dir:
            refuse(f"opening the directory {full}")

    def guard(event: str, args: tuple) -> None:
        if event in denied:
            refuse(event)
        if event.startswith(denied_prefixes):
            if event == "socket.__new__" and _isinstance(args[1], _int) and _int.__eq__(args[1], af_unix) is True:
                return  # socketpair() for asyncio; connect/bind/sendto are refused
            refuse(event)
        if event == "import":
            if _type(args[0]) is not _str or args[0] in denied_modules or args[0].startswith("ctypes."):
                refuse(f"import {args[0]!r}")
        elif event == "open":
            if args[2] & write_flags:
                check_write(args[0])
            else:
                check_read(args[0], args[2])
        elif event in writes:
            for i in writes[event]:
                check_write(args[i])
        elif event in reads:
            check_read(args[0])
        elif event == "sqlite3.connect":
            target = args[0]
            if _type(target) is _str and target in (":memory:", ""):
                return
            if (_type(target) is _str and target.startswith("file:")) or (
                _type(target) is _bytes and target.startswith(b"file:")
            ):
                refuse("sqlite URIs")
            check_write(target)

    # _posixsubprocess.fork_exec creates processes without an audit event: replace it before the
    # program can import it (re-importing the module is refused above).
    import _posixsubprocess

    def fork_exec(*args, **kwargs):
        refuse("process creation")

    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(guard)


# ----------------------------------------------------------------------------- running the program


class Program:
    """The untrusted program and its tests. Every builtin the runner uses after the program started
    is bound before it starts, so a program that rebinds ``builtins.exec`` (say) changes nothing here."""

    def __init__(self, source: str, report, traceback, types):
        self.source, self.report, self.traceback, self.types = source, report, traceback, types
        self.stderr = sys.stderr

    def _print(self, exc: BaseException) -> None:
        """The program's traceback, without the runner's own frame."""
        self.traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next, file=self.stderr)

    def _namespace(self) -> dict:
        module = self.types.ModuleType("__main__")
        module.__file__ = "main.py"
        sys.modules["__main__"] = module
        sys.argv = ["main.py"]
        return module.__dict__

    def _load(self):
        try:
            return compile(self.source, "main.py", "exec", dont_inherit=True, optimize=0)
        except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes in the source
            print("".join(self.traceback.format_exception_only(exc)), end="", file=self.stderr)
            self.report("syntax")
            return None

    def run_tests(self, tests: list[str]) -> int:
        """Run the program, then each test in its namespace; one report line per test, then ``done``."""
        compile_, exec_, type_, print_, enumerate_, base = compile, exec, type, print, enumerate, BaseException
        report, stdout, stderr, tests = self.report, sys.stdout, self.stderr, tuple(tests)
        code = self._load()
        if code is None:
            return 1
        namespace = self._namespace()
        try:
            exec_(code, namespace)
        except base as exc:  # SystemExit too: exiting before the tests fails them
            self._print(exc)
            report(f"raised {type_(exc).__name__}")
            return 1
        for i, test in enumerate_(tests):
            passed, failure = True, "-"
            try:
                exec_(compile_(test, f"<test {i + 1}>", "exec", dont_inherit=True, optimize=0), namespace)
            except base as exc:  # a failing test is a result, whatever it raised
                passed, failure = False, type_(exc).__name__
                try:
                    print_(f"test {i + 1} failed: {failure}: {exc}"[:500], file=stderr, flush=True)
                except base:  # e.g. the output limit; the report below still counts
                    pass
            report(f"test {i} {'1' if passed else '0'} {failure}")
        report("done")
        try:
            stdout.flush()
        except base:  # the output limit
            pass
        return 0

    def run_io(self) -> int:
        """Run the program on stdin; the exit status is the program's (an exception: 1)."""
        exec_, type_, base = exec, type, BaseException
        code = self._load()
        if code is None:
            return 1
        stdout, stderr = sys.stdout, self.stderr
        status = 0
        try:
            exec_(code, self._namespace())
        except SystemExit as exc:
            status = exc.code if type_(exc.code) is int else (0 if exc.code is None else 1)
            if status == 1 and exc.code is not None and type_(exc.code) is not int:
                print(exc.code, file=stderr)
        except base as exc:
            self._print(exc)
            self.report(f"raised {type_(exc).__name__}")
            status = 1
        try:
            stdout.flush()
            stderr.flush()
        except base:  # the output limit: the parent sees the size
            status = status or 1
        return status & 0xFF


if __name__ == "__main__":
    main(sys.argv[1])
