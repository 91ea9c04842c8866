"""The sandbox's seccomp filter: an allow-list at least as strict as Docker's default profile for a container without
capabilities, built with libseccomp (its Python bindings: Debian's `python3-seccomp`, else the `pyseccomp` wheel, a
ctypes binding of the same library), compiled once to BPF and handed to bwrap on a pipe (`--seccomp FD`).

Why: namespaces hide the host's files and processes, but every syscall still reaches the host kernel. Without a
filter, code inside could read the trainer's session keyring (`keyctl`), and reach bpf, userfaultfd,
perf_event_open and io_uring, the usual ways into a kernel bug. Everything not listed below fails with EPERM
(Docker's default errno). `clone3` and the io_uring calls fail with ENOSYS, so libc and runtimes fall back to what
is allowed. The filter is stricter than Docker's in five places: `ptrace`, `process_vm_readv`/`writev` (Docker allows
them), `memfd_create` (memory that no per-process cap counts: without a cgroup, N memfds would hold N x the file-size
cap), SysV shared memory and message queues (HOARDING: memory no per-process cap counts either), and `socket` (only
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK). A syscall of another ABI (32-bit x86 on x86_64)
kills the process (libseccomp's bad-arch action).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

from skyrl_stepwise.sandbox.base import SandboxUnavailable

# Docker's default allow-list (moby/profiles seccomp/default.json, the entries no capability gates), grouped; names
# this architecture lacks are skipped when the filter is built.
_FILES = (
    "access", "chdir", "chmod", "chown", "chown32", "close", "close_range", "copy_file_range", "creat", "dup",
    "dup2", "dup3", "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate", "fchdir", "fchmod",
    "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync", "fgetxattr",
    "flistxattr", "flock", "fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs", "fstatfs64",
    "fsync", "ftruncate", "ftruncate64", "futimesat", "getcwd", "getdents", "getdents64", "getxattr", "getxattrat",
    "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch", "lchown", "lchown32", "lgetxattr",
    "link", "linkat", "listxattr", "listxattrat", "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr",
    "lstat", "lstat64", "mkdir", "mkdirat", "mknod", "mknodat", "name_to_handle_at", "newfstatat", "open", "openat",
    "openat2", "pread64", "preadv", "preadv2", "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink",
    "readlinkat", "readv", "removexattr", "removexattrat", "rename", "renameat", "renameat2", "rmdir", "sendfile",
    "sendfile64", "setxattr", "setxattrat", "splice", "stat", "stat64", "statfs", "statfs64", "statx", "symlink",
    "symlinkat", "sync", "sync_file_range", "syncfs", "tee", "truncate", "truncate64", "umask", "unlink", "unlinkat",
    "utime", "utimensat", "utimensat_time64", "utimes", "vmsplice", "write", "writev", "fanotify_mark",
    "cachestat", "statmount", "listmount",
)
_MEMORY = (
    "brk", "madvise", "map_shadow_stack", "membarrier", "mincore", "mlock", "mlock2", "mlockall", "mmap", "mmap2",
    "mprotect", "mremap", "mseal", "msync", "munlock", "munlockall", "munmap", "pkey_alloc", "pkey_free",
    "pkey_mprotect", "remap_file_pages", "process_mrelease",
)
_PROCESSES = (
    "arch_prctl", "capget", "capset", "execve", "execveat", "exit", "exit_group", "fork", "vfork", "getcpu",
    "getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32", "getpgid",
    "getpgrp", "getpid", "getppid", "getpriority", "getresgid", "getresgid32", "getresuid", "getresuid32",
    "getrlimit", "get_robust_list", "getrusage", "getsid", "get_thread_area", "gettid", "getuid", "getuid32",
    "ioprio_get", "ioprio_set", "kill", "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
    "modify_ldt", "pidfd_open", "pidfd_send_signal", "prctl", "prlimit64", "restart_syscall", "rseq",
    "sched_getaffinity", "sched_getattr", "sched_getparam", "sched_get_priority_max", "sched_get_priority_min",
    "sched_getscheduler", "sched_rr_get_interval", "sched_rr_get_interval_time64", "sched_setaffinity",
    "sched_setattr", "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp", "setfsgid", "setfsgid32",
    "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setpgid", "setpriority",
    "setregid", "setregid32", "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid", "setreuid32",
    "setrlimit", "set_robust_list", "setsid", "set_thread_area", "set_tid_address", "setuid", "setuid32", "tgkill",
    "tkill", "ugetrlimit", "uname", "wait4", "waitid", "waitpid", "times", "sysinfo",
)
_SIGNALS_TIME_EVENTS = (
    "alarm", "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64", "clock_nanosleep",
    "clock_nanosleep_time64", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
    "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "futex", "futex_requeue", "futex_time64",
    "futex_wait", "futex_waitv", "futex_wake", "getitimer", "getrandom", "gettimeofday", "nanosleep", "_newselect",
    "pause", "pipe", "pipe2", "poll", "ppoll", "ppoll_time64", "pselect6", "pselect6_time64", "rt_sigaction",
    "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "select", "setitimer", "sigaltstack", "signalfd", "signalfd4",
    "sigprocmask", "sigreturn", "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
    "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create", "timerfd_gettime",
    "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "ioctl",
    "io_cancel", "io_destroy", "io_getevents", "io_pgetevents", "io_pgetevents_time64", "io_setup", "io_submit",
)
_IPC_NET = (
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt", "listen", "recv",
    "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "send", "sendmmsg", "sendmsg", "sendto", "setsockopt",
    "shutdown", "socketpair", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
    "mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64", "mq_unlink",
    "semctl", "semget", "semop", "semtimedop", "semtimedop_time64",
)
# Docker allows these; its cgroup counts what they hold. Without one, no rlimit does: a SysV shared-memory segment
# stays after shmdt (one process held 512 MiB past a 256 MiB address-space cap, and more the longer it loops), and
# 32,000 message queues hold 16 KiB of kernel memory each. Refused (EPERM), as memfd_create is. POSIX message queues
# stay: RLIMIT_MSGQUEUE bounds them (800 KiB per user by default).
HOARDING = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "ipc")
ALLOWED = _FILES + _MEMORY + _PROCESSES + _SIGNALS_TIME_EVENTS + _IPC_NET
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: PER_LINUX, UNAME26, ADDR_NO_RANDOMIZE, query
CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: refused (as Docker)
ENOSYS_CALLS = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")


def _bindings():
    """libseccomp's Python bindings: the distribution's `seccomp` module, else `pyseccomp` (a dependency)."""
    try:
        import seccomp

        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp

        return pyseccomp
    except Exception as e:  # ImportError, or libseccomp.so.2 missing (the binding loads it at import)
        raise SandboxUnavailable(
            "no seccomp filter can be built: neither libseccomp's Python bindings (`seccomp`, Debian's "
            f"python3-seccomp) nor `pyseccomp` loads ({type(e).__name__}: {e}); `pip install pyseccomp` and install "
            "libseccomp (Debian/Ubuntu: libseccomp2). No sandbox runs without the filter.") from e


def _add(flt, sc, action: int, name: str, *args) -> bool:
    """Add one rule; False where this architecture has no such syscall (e.g. `chown32` on x86_64)."""
    try:
        flt.add_rule(action, name, *args)
        return True
    except (OSError, ValueError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled filter (BPF bytes for `bwrap --seccomp`), built once per process; SandboxUnavailable where
    libseccomp cannot be loaded."""
    sc = _bindings()
    flt = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    for name in ALLOWED:
        _add(flt, sc, sc.ALLOW, name)
    for family in SOCKET_FAMILIES:
        _add(flt, sc, sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family))
    for persona in PERSONALITIES:
        _add(flt, sc, sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    _add(flt, sc, sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NAMESPACE_FLAGS, 0))
    for name in ENOSYS_CALLS:
        _add(flt, sc, sc.ERRNO(errno.ENOSYS), name)
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise SandboxUnavailable(f"libseccomp exported a malformed filter ({len(program)} bytes)")
    return program


def filter_fd() -> int:
    """A fresh pipe's read end holding the filter, for one bwrap (it reads to EOF); the caller closes it after the
    spawn. The program (a few KiB) fits the pipe's buffer, so the write never blocks."""
    program = filter_bpf()
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)
    finally:
        os.close(write_end)
    return read_end
