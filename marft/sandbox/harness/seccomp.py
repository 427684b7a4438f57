"""The candidate's seccomp filter (standard library only): the system calls, ``clone`` flags, socket families,
``fcntl`` commands and ``madvise`` advice it denies, as a classic BPF program, and installing it.
"""

import ctypes
import errno

from .isolation import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_SET_SECCOMP,
)

_len = len

# seccomp: x86_64 system call numbers the candidate may not make (EPERM)
AUDIT_ARCH_X86_64 = 0xC000003E
SYSCALLS_DENIED = (
    101, 310, 311,  # ptrace, process_vm_readv/writev
    272, 308,  # unshare, setns
    29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71, 240,  # System V shm/sem/msg, mq_open
    165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,  # mount, umount2, pivot_root, chroot, new mount API
    250, 248, 249, 321, 298, 323, 425, 426, 427, 438,  # keyrings, bpf, perf, userfaultfd, io_uring, pidfd_getfd
    246, 320, 175, 313, 176, 304, 303, 163, 167, 168, 169, 170, 171, 172, 173, 179, 312, 135, 212, 153, 103,
    # state shared between runs (issue 78): page-cache advice and residency probes, file locks, file watches
    221, 187, 27, 451, 440, 216,  # fadvise64, readahead, mincore, cachestat, process_madvise, remap_file_pages
    73, 253, 254, 294, 300,  # flock, inotify_init, inotify_add_watch, inotify_init1, fanotify_init
)
SYSCALLS_NOSYS = (327, 328)
"""preadv2, pwritev2 (RWF_NOWAIT tells whether a page is cached): ENOSYS, so that libc falls back to preadv/pwritev."""
SYS_FCNTL, SYS_MADVISE = 72, 28
FCNTL_DENIED = (5, 6, 7, 36, 37, 38, 1024, 1026)
"""fcntl commands denied: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK/SETLK/SETLKW (a lock on a file every run reads is
a signal between runs), F_SETLEASE, F_NOTIFY (a watch on a shared folder sees other runs open files)."""
MADVISE_DENIED = (3, 20, 21, 22, 23)
"""madvise advice denied: MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT, MADV_POPULATE_READ/WRITE (page-cache advice)."""
SYS_CLONE, SYS_CLONE3, SYS_SOCKET, SYS_SOCKETPAIR = 56, 435, 41, 53
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCKET_FAMILIES = (AF_INET, AF_INET6)
"""The only families ``socket`` may create (in the candidate's empty network namespace: nothing to reach)."""
SOCKETPAIR_FAMILIES = (AF_UNIX,)
"""The only family ``socketpair`` may create: an unnamed pair, reachable only by the program's own processes
(asyncio's event loop makes one)."""


def seccomp_program():
    """Classic BPF: kill other architectures; EPERM for ``SYSCALLS_DENIED``, namespace flags to ``clone``, a
    ``socket`` of any family but ``SOCKET_FAMILIES``, a ``socketpair`` of any but ``SOCKETPAIR_FAMILIES``, the
    ``FCNTL_DENIED`` commands and ``MADVISE_DENIED`` advice; ENOSYS for ``clone3`` (its flags are out of reach, libc
    falls back to clone) and ``SYSCALLS_NOSYS``."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    deny, nosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    # (opcode, jump target label when the condition holds, k); a failed condition falls through
    blocks = {
        "start": [(ld, None, 4), (jeq, "syscall", AUDIT_ARCH_X86_64), (ret, None, kill)],
        "syscall": [(ld, None, 0), (jge, "deny", 0x40000000), (jeq, "clone", SYS_CLONE), (jeq, "socket", SYS_SOCKET),
                    (jeq, "socketpair", SYS_SOCKETPAIR), (jeq, "fcntl", SYS_FCNTL), (jeq, "madvise", SYS_MADVISE)]
                   + [(jeq, "nosys", nr) for nr in (SYS_CLONE3,) + SYSCALLS_NOSYS]
                   + [(jeq, "deny", nr) for nr in SYSCALLS_DENIED] + [(ret, None, allow)],
        "clone": [(ld, None, 16), (jset, "deny", NAMESPACE_FLAGS), (ret, None, allow)],  # args[0], low 32 bits
        # args[0] (the family, an int: the kernel reads its low 32 bits, as this does)
        "socket": [(ld, None, 16)] + [(jeq, "allow", family) for family in SOCKET_FAMILIES] + [(ret, None, deny)],
        "socketpair": [(ld, None, 16)] + [(jeq, "allow", family) for family in SOCKETPAIR_FAMILIES] + [(ret, None, deny)],
        "fcntl": [(ld, None, 24)] + [(jeq, "deny", cmd) for cmd in FCNTL_DENIED] + [(ret, None, allow)],  # args[1]
        "madvise": [(ld, None, 32)] + [(jeq, "deny", advice) for advice in MADVISE_DENIED] + [(ret, None, allow)],  # args[2]
        "allow": [(ret, None, allow)],
        "nosys": [(ret, None, nosys)],
        "deny": [(ret, None, deny)],
    }
    labels, at = {}, 0
    for name, block in blocks.items():
        labels[name] = at
        at += _len(block)
    out, index = bytearray(), 0
    for block in blocks.values():
        for op, target, k in block:
            jt = labels[target] - index - 1 if target else 0
            if not 0 <= jt < 256:
                raise ValueError("seccomp jump out of range")
            out += op.to_bytes(2, "little") + bytes((jt, 0)) + k.to_bytes(4, "little")
            index += 1
    return bytes(out), index


def install_seccomp(libc):
    import platform

    if platform.machine() != "x86_64":
        return False
    data, count = seccomp_program()
    buffer = ctypes.create_string_buffer(data)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(count, ctypes.addressof(buffer))
    return libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0) == 0
