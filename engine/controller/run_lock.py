"""One training run per --model_dir (invariant 14): the run's lock, `<model_dir>/.lock`.

A training run's chief (the only process of a single-process run) holds an exclusive
`fcntl.flock` on the file for the whole run and writes its host, pid and start time into it. A
second training run on the same directory is refused in one line naming the holder. The kernel
releases a flock when its process dies, so a run killed with SIGKILL leaves no stale lock: the next
run takes the file over and says so in one line. flock is per host (and some network filesystems
ignore it), so a lock file that names a process still alive on this host is refused too, even
when the flock itself was granted. The other workers of a multi-worker run share the chief's
directory and take no lock; neither does an evaluation job (--mode=eval, continuous_eval, the
--evaluator sidecar), which only reads. The file is removed when the run ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

from engine.controller import run_record, storage
from engine.errors import UserError

FILE_NAME = ".lock"


def path(model_dir: str) -> str:
    return os.path.join(model_dir, FILE_NAME)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (clock ticks since boot), None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _identity() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "boot_id": _boot_id(),
        "process_start": _process_start(pid),
    }


def _alive_here(holder: dict) -> bool:
    """Whether the process the lock file names runs on this host now (not a reused pid)."""
    if holder.get("host") != socket.gethostname() or holder.get("pid") == os.getpid():
        return False
    if holder.get("boot_id") and holder.get("boot_id") != _boot_id():
        return False
    start, recorded = _process_start(int(holder.get("pid") or 0)), holder.get("process_start")
    return start is not None and (recorded is None or start == recorded)


def _describe(holder: dict | None) -> str:
    if not holder:
        return "a process that is still writing its lock file"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _read(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode()
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _refusal(model_dir: str, holder: dict | None) -> UserError:
    return UserError(
        f"--model_dir={model_dir} is in use by another training run ({_describe(holder)}; "
        f"{path(model_dir)}): wait for it to end or stop it, or use another --model_dir"
    )


class RunLock:
    """The lock a training run holds on its --model_dir (see the module's docstring)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.fd = None

    def acquire(self) -> str | None:
        """Takes the lock or raises UserError naming its holder; returns a line when it took over
        the file of a process that no longer holds it (None otherwise)."""
        run_record.create_model_dir(self.model_dir)
        target = path(self.model_dir)
        while True:
            try:
                fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                if storage.cause(err):
                    raise storage.failed(
                        f"creating the run's lock {target}", storage.cause(err), self.model_dir
                    ) from None
                raise UserError(
                    f"cannot create {target} ({err.strerror}): a training run needs a writable --model_dir"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = _read(fd)
                    os.close(fd)
                    raise _refusal(self.model_dir, holder) from None
                # no flock on this filesystem: the file's content alone decides
            try:
                same = os.fstat(fd).st_ino == os.stat(target).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the file was removed by its ending holder after we opened it: again
        holder = _read(fd)
        if holder and _alive_here(holder):
            os.close(fd)
            raise _refusal(self.model_dir, holder)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_identity()) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            if not storage.cause(err):
                raise
            raise storage.failed(f"writing the run's lock {target}", storage.cause(err), self.model_dir) from None
        self.fd = fd
        if holder:
            return (
                f"lock         took over {target} from {_describe(holder)}, which no longer holds it "
                "(it ended without releasing it)"
            )
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_ino == os.stat(path(self.model_dir)).st_ino:
                os.remove(path(self.model_dir))
        os.close(self.fd)  # closing releases the flock
        self.fd = None


def is_lock_holder(config) -> bool:
    """Whether this process takes the run's lock: a training job's chief (an evaluation job, and
    the other workers of a multi-worker run, do not)."""
    if config.mode != "train":
        return False
    if config.strategy != "multi_worker_mirrored":
        return True
    from engine.distribute.cluster import parse_tf_config

    return parse_tf_config(os.environ.get("TF_CONFIG")).is_chief


@contextlib.contextmanager
def held(config, out):
    """The run's lock around a training job (nothing for a process that takes none)."""
    if not is_lock_holder(config):
        yield
        return
    lock = RunLock(config.model_dir)
    line = lock.acquire()
    if line:
        out.write(line + "\n")
        out.flush()
    try:
        yield
    finally:
        lock.release()
