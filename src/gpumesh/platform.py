"""What this machine's OS offers, asked in one place, with the fallback's name.

The provider (``gpumesh share``) needs Linux. A consumer runs on Linux,
macOS and Windows, and every call on its path that only some of them have
asks here first and takes a portable way when the answer is no:

* ``gso``, ``gro``: UDP segmentation and receive offload (Linux only): one
  syscall per datagram instead.
* ``sendmsg``: ``socket.sendmsg``/``recvmsg`` (not on Windows): ``sendto``/``recvfrom``.
* ``unix``: ``AF_UNIX`` sockets (not on Windows): the node process's control
  API on TCP only, shells' bytes over it.
* ``procfd``: ``/proc/self/fd/N`` paths (Linux only): a unix socket's path
  must then be short, or there is none.
* ``termios``: raw mode of the local terminal (not on Windows): ``exec`` runs
  without a terminal, stdin piped.
* ``sigwinch``: the terminal's resize signal (not on Windows): the window's
  size is polled.
* ``signals``: ``loop.add_signal_handler`` and ``kill(pid, 0)`` (not on
  Windows): ``signal.signal`` hands signals to the loop; no process probe.
* ``add_reader``: the default loop watches descriptors (not Windows'
  Proactor): a selector loop for sockets, a thread for stdin.
* ``dir_fd``: calls relative to a folder's descriptor (``openat``,
  ``fdopendir``; not on Windows): a folder to upload is walked by path.
* ``fcntl``: ``fcntl`` and its ioctls (not on Windows): fewer address hints.
* ``nofollow``: ``os.O_NOFOLLOW`` (not on Windows): ``lstat`` first, then the
  file opened is checked to be the one looked at.
* ``oflags``: ``O_NONBLOCK``, ``O_CLOEXEC``, ``O_DIRECTORY`` (not on Windows):
  left out (Windows' ``os.open`` never lets children inherit).
* ``fchmod``: ``os.fchmod`` and ``os.utime`` of a descriptor (not on
  Windows): the same by path.
* ``pread``: ``os.pread``/``preadv`` (not on Windows): a seek and a read
  under one lock.
* ``modes``: POSIX permission bits mean something (not on Windows, where a
  home is guarded by its folder's ACL): checks of modes are skipped.
* ``getuid``: ``os.getuid``/``geteuid`` (not on Windows): no owner to compare.

Each answer is the real probe, unless ``GPUMESH_TEST_PLATFORM`` (``macos`` or
``windows``: switch off what that OS lacks) or ``GPUMESH_TEST_WITHOUT`` (a
comma list of facilities) switches it off: the tests run the consumer that
way, since only Linux machines run them. Under either, every fallback taken
is logged once at info, and, with ``GPUMESH_TEST_PLATFORM_REPORT=FILE``,
appended to FILE (one ``took NAME`` line each) together with any Linux-only
call that slipped past this module (``used NAME``: an ``AF_UNIX`` socket, a
``sendmsg``, an ``O_NOFOLLOW`` or ``O_DIRECTORY`` open, a listing of a
descriptor, an ``fcntl`` call, seen by an audit hook), so a test can show
that the other platforms' code really ran.

Nothing here imports from the rest of the package but :mod:`gpumesh.settings`
and :mod:`gpumesh.errors`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from gpumesh.errors import ConfigError
from gpumesh.settings import ENV_TEST_PLATFORM, ENV_TEST_PLATFORM_REPORT, ENV_TEST_WITHOUT

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "BINARY",
    "FACILITIES",
    "LACKS",
    "System",
    "add_signal_handler",
    "at_idle_priority",
    "chmod_open",
    "configure",
    "has",
    "open_flag",
    "pread",
    "preadv",
    "system",
    "system_name",
    "taken",
    "utime_open",
    "write_all",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
System = Literal["linux", "macos", "windows", "other"]

FACILITIES = (
    "gso",
    "gro",
    "sendmsg",
    "unix",
    "procfd",
    "termios",
    "sigwinch",
    "signals",
    "add_reader",
    "dir_fd",
    "fcntl",
    "nofollow",
    "oflags",
    "fchmod",
    "pread",
    "modes",
    "getuid",
)
"""Every facility :func:`has` answers for (the table above)."""

LACKS: dict[str, frozenset[str]] = {
    "linux": frozenset(),
    "macos": frozenset({"gso", "gro", "procfd"}),
    "windows": frozenset(FACILITIES),
}
"""What each OS lacks, as ``GPUMESH_TEST_PLATFORM`` switches it off."""


BINARY: int = getattr(os, "O_BINARY", 0)
"""Add to every ``os.open`` of a file's bytes: Windows opens in text mode without it."""


def _real_system() -> System:
    named: dict[str, System] = {"linux": "linux", "darwin": "macos", "win32": "windows"}
    return named.get(sys.platform, "other")


def _probe(name: str) -> bool:
    """Whether the running Python and OS have ``name``, not counting any switch."""
    linux = sys.platform.startswith("linux")
    if name in ("gso", "gro", "procfd"):
        return linux
    if name == "sendmsg":
        return hasattr(socket.socket, "sendmsg") and hasattr(socket.socket, "recvmsg")
    if name == "unix":
        return hasattr(socket, "AF_UNIX") and sys.platform != "win32"
    if name == "termios":
        try:
            import termios  # noqa: F401
            import tty  # noqa: F401
        except ImportError:
            return False
        return True
    if name == "sigwinch":
        return hasattr(signal, "SIGWINCH")
    if name in ("signals", "add_reader", "modes"):
        return sys.platform != "win32"
    if name == "dir_fd":
        return os.open in os.supports_dir_fd and os.scandir in os.supports_fd
    if name == "fcntl":
        try:
            import fcntl  # noqa: F401
        except ImportError:
            return False
        return True
    if name == "nofollow":
        return hasattr(os, "O_NOFOLLOW")
    if name == "oflags":
        return all(hasattr(os, flag) for flag in ("O_NONBLOCK", "O_CLOEXEC", "O_DIRECTORY"))
    if name == "fchmod":
        return hasattr(os, "fchmod") and os.utime in os.supports_fd
    if name == "pread":
        return hasattr(os, "pread") and hasattr(os, "preadv")
    if name == "getuid":
        return hasattr(os, "getuid") and hasattr(os, "geteuid")
    raise ValueError(f"unknown platform facility {name!r}")


_PROBED = {name: _probe(name) for name in FACILITIES}
"""Each probe's answer, asked once at import: the OS does not change while we run."""


class _State:
    simulated: System | None = None
    off: frozenset[str] = frozenset()
    taken: ClassVar[set[str]] = set()
    report: str | None = None
    loaded = False
    audited = False


def configure(environ: Mapping[str, str] | None = None) -> None:
    """Read the switches again, from ``environ`` (default: the process's
    environment), forgetting the fallbacks taken so far; for tests."""
    _State.loaded = False
    _State.simulated = None
    _State.taken.clear()
    _load(os.environ if environ is None else environ)


def _load(environ: Mapping[str, str] | None = None) -> None:
    if _State.loaded:
        return
    _State.loaded = True

    def env(name: str) -> str | None:
        return (os.environ if environ is None else environ).get(name, "").strip() or None

    off: set[str] = set()
    chosen = (env(ENV_TEST_PLATFORM) or "").lower()
    if chosen:
        if chosen not in LACKS:
            raise ConfigError(f"{ENV_TEST_PLATFORM}={chosen!r}: use linux, macos or windows")
        _State.simulated = chosen  # type: ignore[assignment]
        off |= LACKS[chosen]
    for item in (env(ENV_TEST_WITHOUT) or "").split(","):
        if item.strip():
            if item.strip() not in FACILITIES:
                raise ConfigError(
                    f"{ENV_TEST_WITHOUT}: unknown facility {item.strip()!r} "
                    f"(known: {', '.join(FACILITIES)})"
                )
            off.add(item.strip())
    _State.off = frozenset(off)
    _State.report = env(ENV_TEST_PLATFORM_REPORT)
    if off:
        logger.info("simulating a platform without: %s", ", ".join(sorted(off)))
        if not _State.audited:
            _State.audited = True
            sys.addaudithook(_audit)  # for the process's life: hooks cannot be removed


def system_name() -> str:
    """:func:`system` as people write it: ``macOS``, ``Windows``, ``Linux``."""
    found = system()
    return {"linux": "Linux", "macos": "macOS", "windows": "Windows"}.get(found, sys.platform)


def system() -> System:
    """The OS, as ``GPUMESH_TEST_PLATFORM`` may pretend it is."""
    _load()
    return _State.simulated or _real_system()


def has(name: str) -> bool:
    """Whether ``name`` (one of :data:`FACILITIES`) is there; a no is remembered
    as a fallback taken."""
    _load()
    if name in _State.off or not _PROBED[name]:
        if name not in _State.taken:
            _State.taken.add(name)
            logger.info("platform: without %s, taking the fallback", name)
            _write_report(f"took {name}")
        return False
    return True


def taken() -> frozenset[str]:
    """The facilities asked for and found missing in this process so far."""
    return frozenset(_State.taken)


def open_flag(name: str) -> int:
    """``os.O_NOFOLLOW`` (facility ``nofollow``) or ``O_NONBLOCK``/``O_CLOEXEC``/
    ``O_DIRECTORY`` (``oflags``); 0 where the OS lacks it."""
    facility = "nofollow" if name == "O_NOFOLLOW" else "oflags"
    if not has(facility):
        return 0
    value: int = getattr(os, name)
    return value


def chmod_open(fd: int, path: str | os.PathLike[str], mode: int) -> None:
    """``fchmod`` where the OS has it, else ``chmod`` of the path just opened."""
    if has("fchmod"):
        os.fchmod(fd, mode)
    else:
        os.chmod(path, mode)


def utime_open(fd: int, path: str | os.PathLike[str], mtime: float) -> None:
    """Set the times of the file open as ``fd`` (at ``path``) to ``mtime``."""
    os.utime(fd if has("fchmod") else path, (mtime, mtime))


_SEEK_LOCK = threading.Lock()
"""Serializes the fallback's seek-then-read: positional reads of one file may run
on several threads at once (a hash behind, a send ahead)."""


def pread(fd: int, size: int, offset: int) -> bytes:
    """``os.pread``; where it is missing, a seek and a read under one lock
    (every positional read goes through here, so none moves another's offset)."""
    if has("pread"):
        return os.pread(fd, size, offset)
    with _SEEK_LOCK:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, size)


def preadv(fd: int, buffer: memoryview, offset: int) -> int:
    """Read into ``buffer`` from ``offset``, as ``os.preadv(fd, [buffer], offset)``."""
    if has("pread"):
        return os.preadv(fd, [buffer], offset)
    data = pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


WRITE_SLICE = 256 << 10
"""Most bytes per ``write()`` of :func:`write_all`. The page cache takes a write's
bytes in folios as large as the write allows (up to 2 MiB); on the virtual
machine measured, large folios were the expensive ones (fresh large blocks of
guest memory are likely ones the host has taken back and must fault in again).
Copying 1 GiB onto disk, the whole machine spent 4.8-5.9 s of kernel CPU with
the receiver writing 1 MiB at a time, 1.1-1.6 s writing 256 KiB at a time
(scp's copies: 2.3-3.4 s); 4 MiB writes were slower still."""


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` at ``fd``'s position, at most :data:`WRITE_SLICE` bytes a call."""
    while data:
        data = data[os.write(fd, data[:WRITE_SLICE]) :]


def at_idle_priority(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` for a thread of its own (:func:`gpumesh.blocking.in_thread`'s),
    which first drops to the lowest CPU priority (Linux ``SCHED_IDLE``: it runs only
    when nothing else wants the core). For background work that must leave the CPU
    to the work it serves: a job's outputs on their way home while the job runs.
    Elsewhere, or where the OS refuses, it runs as it is."""

    def idle(*args: Any) -> T:
        policy = getattr(os, "SCHED_IDLE", None)
        if policy is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, policy, os.sched_param(0))  # this thread only
        return function(*args)

    return idle


def add_signal_handler(
    loop: asyncio.AbstractEventLoop, signum: int, callback: Callable[[], None]
) -> Callable[[], None]:
    """Call ``callback`` in ``loop`` on ``signum``; the function that undoes it.

    Without ``loop.add_signal_handler`` (Windows), ``signal.signal`` hands the
    signal to the loop from the main thread's handler."""
    if has("signals"):
        loop.add_signal_handler(signum, callback)

        def undo() -> None:
            loop.remove_signal_handler(signum)

        return undo
    previous = signal.signal(signum, lambda _s, _f: loop.call_soon_threadsafe(callback))

    def restore() -> None:
        signal.signal(signum, previous)

    return restore


# --- the audit of a simulation --------------------------------------------------

_AF_UNIX = getattr(socket, "AF_UNIX", None)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Runs on every audited event of the process: cheap tests first.
    for name in _linux_only(event, args):
        if name in _State.off:
            _used(name)
            return


def _linux_only(event: str, args: tuple[Any, ...]) -> tuple[str, ...]:
    """The facilities an audited event uses, of those a simulation can switch off."""
    if event == "socket.__new__" and len(args) > 1 and _AF_UNIX is not None:
        # asyncio's wake-up pair is a socketpair: AF_INET where there is no AF_UNIX
        unix = args[1] == _AF_UNIX and not _called_from("socketpair")
        return ("unix",) if unix else ()
    if event == "socket.sendmsg":
        return ("sendmsg", "gso")
    if event.startswith("fcntl."):
        # A simulated Windows locks a home with a POSIX byte lock for msvcrt's.
        return () if _called_from("_byte_lock") else ("fcntl",)
    if event == "open" and len(args) > 2 and isinstance(args[2], int):
        flags = args[2]
        nofollow = ("nofollow",) if flags & getattr(os, "O_NOFOLLOW", 0) else ()
        return nofollow + (("oflags",) if flags & getattr(os, "O_DIRECTORY", 0) else ())
    if event in ("os.scandir", "os.listdir") and args and isinstance(args[0], int):
        return ("dir_fd",)
    return ()


def _called_from(function: str) -> bool:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _used(name: str) -> None:
    where = _caller()
    logger.warning("platform simulation: %s used although switched off, at %s", name, where)
    _write_report(f"used {name} at {where}")


def _caller() -> str:
    """The innermost frame of this package outside this module: where the call was made."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}gpumesh{os.sep}" in path and not path.endswith("platform.py"):
            return f"{path.rsplit(os.sep, 2)[-2]}/{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _write_report(line: str) -> None:
    if _State.report is None:
        return
    try:
        fd = os.open(_State.report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {line}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass
