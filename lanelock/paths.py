"""The canonical lock root: one gate, not two.

Every process on the box must compute the same root whatever its HOME, XDG variables, cwd or user:
an interactive shell, a cron job under ``env -i`` and an agent profile with its own HOME. So the
default never looks at HOME or XDG_RUNTIME_DIR; it is chosen by the mode and owner of /run/lock, which
every user sees alike (``access()`` would answer differently per user and split the gate).
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import GateCrowded, GateUnavailable, GateUntrusted

RUN_LOCK = "/run/lock"
SHARED_ROOT = os.path.join(RUN_LOCK, "lanelock")
TMP_ROOT = "/tmp/lanelock"
ROOT_MODE = 0o1777  # sticky and world-writable, like /tmp: every local user shares the gate


class Root:
    """Where the lock files live and why (a plain class: `typing` costs the run path milliseconds)."""

    __slots__ = ("path", "source", "detail")

    def __init__(self, path: str, source: str, detail: str):
        self.path = path
        self.source = source   # "flag", "env", "system-config", "default"
        self.detail = detail   # a sentence a person can read: why this root

    def __eq__(self, other) -> bool:
        return isinstance(other, Root) and (self.path, self.source, self.detail) == (
            other.path, other.source, other.detail)

    def __repr__(self) -> str:
        return f"Root({self.path!r}, {self.source!r}, {self.detail!r})"


def default_root() -> Root:
    try:
        st = os.stat(RUN_LOCK)
    except OSError as error:
        return Root(TMP_ROOT, "default", f"{RUN_LOCK} unusable ({error.strerror}); using {TMP_ROOT}")
    shared = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & ROOT_MODE == ROOT_MODE
    if shared:
        return Root(SHARED_ROOT, "default", f"{RUN_LOCK} is root-owned, sticky and world-writable")
    return Root(TMP_ROOT, "default", f"{RUN_LOCK} is not sticky world-writable; using {TMP_ROOT}")


def resolve_root(settings) -> Root:
    """The lock_dir setting (flag, LANELOCK_DIR, the system file's lock_dir), else the default."""
    value, source = settings.lookup("lock_dir")
    if not value:
        return default_root()
    if source == "flag":
        return Root(os.path.abspath(value), "flag", "set by --lock-dir")
    if source.startswith("env "):
        return Root(os.path.abspath(value), "env", f"set by {source[4:]}")
    return Root(os.path.abspath(value), "system-config",
                f"set by lock_dir in {source.removeprefix('system file ')}")


# What a gate that cannot be taken means for the turns (where, probe, status say it alike).
UNGATED = "turns here would run ungated (fail open)"
DEFLECTING = "turns here deflect until it is fixed (never ungated)"


def consequence(error: GateUnavailable) -> str:
    """What turns do on a gate that raised error: a crowded or untrusted one deflects (the gate
    is there), any other fails open."""
    return DEFLECTING if isinstance(error, GateCrowded) else UNGATED


def creation_problem(root: Root) -> str | None:
    """Why a turn could not create a lane's lock file under the root (it would fail open), found
    without creating anything; None when it could. A read-only, full or misplaced root must never
    read as "free": every turn there would run ungated.

    What exists must open as a turn opens it (open_root: no symlink, a trusted directory). What
    does not must be creatable: the root (mkdir makes only its last component) in its parent, a
    lock file in the root. An unnamed file (O_TMPFILE) asks the file system itself what creating
    would meet -- read-only, no inode left, no permission -- and leaves nothing behind."""
    try:
        fd = open_root(root, create=False)
    except FileNotFoundError:
        error = _cannot_create_in(os.path.dirname(root.path))
        return f"{_why(root.path, error, creating=True)}: {UNGATED}" if error else None
    except GateUnavailable as error:
        return f"{error}: {consequence(error)}"
    try:
        error = _cannot_create_in(".", fd)
    finally:
        os.close(fd)
    return f"cannot create lock files in {root.path}: {error.strerror}: {UNGATED}" if error else None


def _cannot_create_in(directory: str, dir_fd: int | None = None) -> OSError | None:
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd))
        return None
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return error
    # No O_TMPFILE on this file system (NFS, older kernels): permission and read-only-ness only.
    try:
        read_only = os.statvfs(directory if dir_fd is None else f"/proc/self/fd/{dir_fd}").f_flag \
            & os.ST_RDONLY
    except OSError as error:
        return error
    if read_only:
        return OSError(errno.EROFS, os.strerror(errno.EROFS))
    if not os.access(directory, os.W_OK | os.X_OK, dir_fd=dir_fd,
                     effective_ids=os.access in os.supports_effective_ids):
        return OSError(errno.EACCES, os.strerror(errno.EACCES))
    return None


def open_root(root: Root, *, create: bool) -> int:
    """An O_DIRECTORY fd on the root, never through a symlink; creates the last component if asked.

    Raises GateUnavailable (or FileNotFoundError when create is False and it does not exist).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root.path, flags)   # the usual case: it exists (no mkdir syscall per turn)
    except FileNotFoundError:
        if not create:
            raise
        _make_root(root.path)
        try:
            fd = os.open(root.path, flags)
        except FileNotFoundError:
            raise GateUnavailable(f"lock root {root.path} is missing") from None
        except OSError as error:
            raise GateUnavailable(_why(root.path, error)) from None
    except OSError as error:
        raise GateUnavailable(_why(root.path, error)) from None
    try:
        _check_trust(root, os.fstat(fd))
    except GateUnavailable:
        os.close(fd)
        raise
    return fd


def _make_root(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    except OSError as error:
        raise GateUnavailable(_why(path, error, creating=True)) from None
    # mkdir obeys the umask; the shared mode must be set explicitly, and only on a directory we made.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, ROOT_MODE)
        finally:
            os.close(fd)
    except OSError as error:
        raise GateUnavailable(_why(path, error, creating=True)) from None


def _check_trust(root: Root, st: os.stat_result) -> None:
    """Refuse a root in which someone else could remove, replace or lock out our lock files:
    removing a lock file under its holder splits the lane in two, a chmod switches
    the gate off for everyone. So: never one writable by group or others without the sticky bit,
    whoever owns it; and never a default root owned by another unprivileged user, who may do all
    of that in it sticky or not (a "root squat": made first after boot). Another root is not
    taken instead: every process must compute the same path (one gate, not two). Nor does the
    turn fail open: that would let whoever made the root switch the gate off for everyone. It
    deflects (GateUntrusted), saying the fix."""
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise GateUntrusted(
            f"lock root {root.path} is owned by uid {st.st_uid} and writable by others without "
            f"the sticky bit; not trusting it: {_fix(root)}")
    if root.source == "default" and st.st_uid not in (0, os.geteuid()):
        raise GateUntrusted(
            f"lock root {root.path} is owned by {_user(st.st_uid)}, who could remove or lock "
            f"out every lane in it; not trusting it: {_fix(root)}")


def _fix(root: Root) -> str:
    if root.source == "default":
        return f"as root, rm -rf {root.path} && install -d -m 1777 {root.path}"
    return f"chmod +t {root.path}, or choose another lock_dir"


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _why(path: str, error: OSError, creating: bool = False) -> str:
    if error.errno == errno.ELOOP:
        return f"lock root {path} is a symlink"
    if error.errno == errno.ENOTDIR:
        if creating or not os.path.lexists(path):
            return f"cannot create lock root {path}: a parent is not a directory"
        return f"lock root {path} is not a directory"
    verb = "cannot create" if creating else "cannot open"
    return f"{verb} lock root {path}: {error.strerror}"
