"""The ``cubefs-fuse`` command line. Exit codes: 0 success, 1 a runtime failure, 2 a user
mistake (bad config or arguments), which is one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import logging
import logging.handlers
import os
import select
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from importlib import resources

from cubefs_fuse import __version__, mounts, opscli
from cubefs_fuse.config import ClientConfig, check_environment, check_fuse_access, load_config, user_allow_other
from cubefs_fuse.sources import check_source
from cubefs_fuse.control import volfile
from cubefs_fuse.control.keeper import keeper_socket_path, request_upgrade
from cubefs_fuse.errors import ConfigError, sole_exception

log = logging.getLogger("cubefs_fuse")
PROG = "cubefs-fuse"
# How long `mount` waits for the daemon to report a live mount.  Start-up is normally
# well under 2 s; a crash-recovery scan of a very large NVMe cache can take longer.
READY_TIMEOUT = 120.0
# While waiting, say so this often: a silent minute looks like a hang.
READY_PROGRESS_EVERY = 10.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The example client configs installed with the package (cubefs_fuse/examples/NAME.json).
EXAMPLES = ("minimal", "nfs-dataset", "cubefs-compatible", "s3-dataset")


class UserError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Mount a remote/NFS dataset volume through a local RAM + NVMe block cache.",
        epilog="Run 'cubefs-fuse COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    mount = opscli.add_command(
        sub, "mount", cmd_mount,
        help="mount a volume described by a JSON client config",
        description="Mount the volume described by CONFIG (`cubefs-fuse example-config` prints examples). "
        "Without --foreground the daemon detaches and the command returns once the mount "
        "is live, or fails with the reason.  The daemon runs under a keeper process, which "
        "holds the mount and has a standby daemon take it over if the daemon dies (readers pause).",
    )
    mount.add_argument("-c", "--config", required=True, metavar="CONFIG", help="JSON client config file")
    mount.add_argument("-f", "--foreground", action="store_true",
                       help="stay in the foreground (the keeper) and log to stderr (for systemd and Kubernetes)")
    mount.add_argument("--ready-timeout", type=_seconds, default=READY_TIMEOUT, metavar="SECONDS",
                       help=f"how long to wait for the detached daemon to mount (default {READY_TIMEOUT:.0f}); "
                       "past it the command fails but the daemon keeps starting")
    mount.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # The daemon itself, run by the keeper (control/keeper.py) over a channel: to mount, to
    # take the mount over from the running daemon (an upgrade) or to recover a dead one's.
    mount.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    mount.add_argument("--channel-fd", type=int, default=None, help=argparse.SUPPRESS)
    mount.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)  # log to the log file
    role = mount.add_mutually_exclusive_group()
    role.add_argument("--take-over", action="store_true", help=argparse.SUPPRESS)
    role.add_argument("--recover", action="store_true", help=argparse.SUPPRESS)

    upgrade = opscli.add_command(
        sub, "upgrade", cmd_upgrade,
        help="hand a live mount to a new daemon (this installation's version) without unmounting",
        description="Start a new daemon for MOUNTPOINT with the client config it was mounted with, and "
        "have the running daemon hand it the mount: readers pause (the pause is reported), no read "
        "fails, open files stay open.  If the new daemon cannot start, the running one serves on.",
    )
    upgrade.add_argument("mount_point", nargs="?", metavar="MOUNTPOINT")
    upgrade.add_argument("-c", "--config", metavar="CONFIG",
                         help="upgrade the mountPoint of this client config (for systemd's ExecReload)")
    upgrade.add_argument("--ready-timeout", type=_seconds, default=READY_TIMEOUT, metavar="SECONDS",
                         help=f"how long to wait for the new daemon to serve (default {READY_TIMEOUT:.0f})")

    umount = opscli.add_command(
        sub, "umount", cmd_umount,
        help="unmount a cubefs-fuse mount and wait for its daemon to finish",
        description="Unmount MOUNTPOINT and wait until its daemon has saved the cache index.",
    )
    umount.add_argument("mount_point", nargs="?", metavar="MOUNTPOINT")
    umount.add_argument("-c", "--config", metavar="CONFIG",
                        help="unmount the mountPoint of this client config (for systemd's ExecStop)")
    umount.add_argument("-l", "--lazy", action="store_true",
                        help="detach now even if files are open (they keep working until closed)")
    umount.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long to wait for the daemon to exit (default: 60)")
    opscli.add_commands(sub)

    example = opscli.add_command(
        sub, "example-config", cmd_example_config,
        help="print an example client config (JSON)",
        description="Print an example client config, to redirect into a file and edit: "
        f"{', '.join(EXAMPLES)} (default: {EXAMPLES[0]}).",
    )
    example.add_argument("name", nargs="?", default=EXAMPLES[0], metavar="NAME")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    run: Callable[[argparse.Namespace], int] = args.run  # each command's parser names its function
    try:
        return run(args)
    except (ConfigError, UserError, opscli.OpsError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, opscli.OpsError) and not isinstance(exc, opscli.UsageError) else 2
    except KeyboardInterrupt:
        return 130


# -- mount ---------------------------------------------------------------------------


def _load_and_check(path: str, *, warn: bool = True, take_over: bool = False) -> ClientConfig:
    """The config, checked against the machine; a mistake raises ConfigError.  The checks
    that only read (a live daemon of the volume above all) come before check_environment,
    which creates the cache and log directories: a refused mount writes nothing.
    ``take_over``: the mount and its daemon are there, and to be taken over."""
    config = load_config(path)
    if not take_over:
        mounts.prepare_mount_point(config.mount_point)
        _refuse_a_second_daemon(config)
    check_environment(config, mounted=take_over)
    check_source(config)
    check_fuse_access()
    if warn and os.geteuid() != 0 and not user_allow_other():
        print(f"{PROG}: warning: mounting without allow_other (add user_allow_other to /etc/fuse.conf): "
              f"only uid {os.geteuid()} can read {config.mount_point}", file=sys.stderr)
    return config


def _refuse_a_second_daemon(config: ClientConfig) -> None:
    """A volume is served by one daemon: a second one would take over its control socket
    and, detached, write its failure into the live daemon's log file (<logDir>/<volName>.log)."""
    live = mounts.serving(config.vol_name)
    if live is not None:
        raise ConfigError(f"key 'volName': volume {config.vol_name!r} is already served by daemon pid "
                          f"{live['pid']} on {live['mountPoint']} (unmount it first: {PROG} umount {live['mountPoint']})")
    socket_path = mounts.control_socket_path(config.vol_name, config.control_socket)
    if mounts.socket_in_use(socket_path):
        key = "controlSocket" if config.control_socket else "volName"
        raise ConfigError(f"key {key!r}: the control socket {socket_path} is in use by a running process "
                          f"(another daemon of volume {config.vol_name!r}?)")


def cmd_mount(args: argparse.Namespace) -> int:
    if args.serve:
        if args.channel_fd is None:
            raise UserError("--serve is run by cubefs-fuse itself (with --channel-fd)")
        return _serve(args.config, args.channel_fd, "take-over" if args.take_over else
                      "recover" if args.recover else "start", args.detached)
    if args.foreground:
        return _keep(args.config, args.ready_fd)
    config = _load_and_check(args.config)
    return _mount_background(args.config, config, args.ready_timeout)


def _log_file(config: ClientConfig) -> str:
    if config.log_dir:
        directory = config.log_dir
    elif os.geteuid() == 0:
        directory = "/var/log/cubefs-fuse"
    else:
        directory = os.path.join(os.path.expanduser("~"), ".cache", "cubefs-fuse")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{config.vol_name}.log")


def _open_log(path: str) -> int:
    """The daemon's log file for appending, mode 0600: it names the files applications read.
    A log file of an older version (0644) is tightened; a symlink is not followed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the log file {path!r}: {exc.strerror}") from None
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o600)
    return fd


def _mount_background(config_path: str, config: ClientConfig, ready_timeout: float) -> int:
    """Start the keeper and its daemon detached and wait for the daemon's report."""
    log_path = _log_file(config)
    read_fd, write_fd = os.pipe()
    with os.fdopen(_open_log(log_path), "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cubefs_fuse", "mount", "-c", os.path.abspath(config_path),
             "--foreground", f"--ready-fd={write_fd}"],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            start_new_session=True, cwd="/",
        )
    os.close(write_fd)
    message = _read_ready(read_fd, proc, ready_timeout)
    if message is not None and message.split(" ", 1)[0] == "ok":
        info = mounts.registered(config.mount_point) or {}
        print(f"{PROG}: mounted {config.source} on {config.mount_point} (pid {info.get('pid', '?')}, "
              f"keeper pid {proc.pid}, log {log_path})")
        return 0
    if message is None:
        # Not killed: a daemon recovering a very large NVMe cache may just need longer, and
        # killing it would throw that work away.  The operator decides.
        print(f"{PROG}: error: the daemon (pid {proc.pid}) has not mounted {config.mount_point} within "
              f"{ready_timeout:.0f} s; it keeps starting in the background: follow {log_path}, check "
              f"'cubefs-fuse status', or stop it with 'kill {proc.pid}'", file=sys.stderr)
        return 1
    code = proc.wait()
    print(f"{PROG}: error: {message.removeprefix('error: ') if message else f'the daemon exited with status {code}'}"
          f" (log: {log_path})", file=sys.stderr)
    return 2 if code == 2 else 1


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds between 0 and 1000000")
    return value


def _read_ready(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The daemon's one-line report; "" if it exited silently, None on timeout."""
    started = time.monotonic()
    deadline = started + timeout
    every = min(READY_PROGRESS_EVERY, timeout / 3)
    next_progress = started + every
    data = b""
    try:
        while time.monotonic() < deadline:
            if time.monotonic() >= next_progress:
                print(f"{PROG}: waiting for the daemon (pid {proc.pid}) to mount: "
                      f"{time.monotonic() - started:.0f} s so far", file=sys.stderr, flush=True)
                next_progress += every
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return data.decode(errors="replace").strip()
                data += chunk
                if data.endswith(b"\n"):
                    return data.decode(errors="replace").strip()
            elif proc.poll() is not None and not data:
                return ""
        return None
    finally:
        os.close(fd)


class _PrivateLogHandler(logging.handlers.WatchedFileHandler):
    """WatchedFileHandler whose file, also a new one after logrotate, is opened by
    :func:`_open_log`: mode 0600 and never through a symlink."""

    def _open(self):  # type: ignore[no-untyped-def]  # typeshed: TextIOWrapper
        return os.fdopen(_open_log(self.baseFilename), "a", encoding=self.encoding or "utf-8")


def _setup_logging(config: ClientConfig, *, detached: bool) -> None:
    level = {"warn": "WARNING"}.get(config.log_level, config.log_level.upper())
    # Log files are written through WatchedFileHandler, which reopens the file when
    # logrotate has moved it away (deploy/logrotate/cubefs-fuse): no signal, no copytruncate.
    # Detached, stderr is the same log file (opened by the parent, for tracebacks); the
    # handler replaces it so that records follow the rotation.  In the foreground stderr
    # is the journal under systemd, the container log under Kubernetes.
    handlers: list[logging.Handler] = [_PrivateLogHandler(_log_file(config)) if detached
                                       else logging.StreamHandler(sys.stderr)]
    if config.log_dir and not detached:
        handlers.append(_PrivateLogHandler(os.path.join(config.log_dir, f"{config.vol_name}.log")))
    logging.basicConfig(level=level, format=LOG_FORMAT, handlers=handlers, force=True)
    # The S3 backend's client libraries log every request at debug level (headers and
    # signatures included): the daemon's debug log is about the daemon, their warnings stay.
    for name in ("boto3", "botocore", "urllib3", "s3transfer"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def cmd_upgrade(args: argparse.Namespace) -> int:
    if (args.mount_point is None) == (args.config is None):
        raise UserError("give either MOUNTPOINT or -c CONFIG")
    mount_point = os.path.abspath(args.mount_point or load_config(args.config).mount_point)
    info = mounts.registered(mount_point)
    if info is None or not _alive(info):
        raise UserError(f"no cubefs-fuse daemon serves {mount_point} (mount it: {PROG} mount -c CONFIG)")
    config_path = info.get("config")
    if not isinstance(config_path, str) or not config_path:
        raise UserError(f"the daemon of {mount_point} (pid {info['pid']}) does not name its client config: "
                        "it is of a version without upgrades; unmount and mount again")
    control = info.get("controlSocket")
    if not isinstance(control, str) or not os.path.exists(keeper_socket_path(control)):
        raise UserError(f"the daemon of {mount_point} (pid {info['pid']}, version {info.get('version', '?')}) "
                        "has no keeper to start a new daemon (a version before upgrades): unmount and mount again")
    config = _load_and_check(config_path, take_over=True)
    if os.path.abspath(config.mount_point) != mount_point:
        raise ConfigError(f"key 'mountPoint': {config_path} now names {config.mount_point}, not {mount_point}: "
                          "an upgrade keeps the mount where it is (unmount, then mount with the new config)")

    def progress(waited: float) -> None:
        print(f"{PROG}: waiting for the new daemon to take {mount_point} over: {waited:.0f} s so far",
              file=sys.stderr, flush=True)

    try:
        reply = request_upgrade(control, args.ready_timeout, progress)
    except (OSError, ValueError) as exc:
        raise opscli.OpsError(f"the keeper of {mount_point} did not answer the upgrade: {exc}") from None
    log_path = _log_file(config)
    if not reply.get("ok"):
        print(f"{PROG}: error: {reply.get('error', 'the upgrade failed')} (log: {log_path})", file=sys.stderr)
        return 1
    print(f"{PROG}: upgraded {mount_point}: daemon pid {reply.get('previous')} (version "
          f"{info.get('version', '?')}) handed it to pid {reply.get('pid')} (version {__version__}); "
          f"{reply.get('detail') or 'readers paused'} (log {log_path})")
    return 0


def _keep(config_path: str, ready_fd: int | None) -> int:
    """Run the keeper (control/keeper.py): the daemon as its child, recovered if it dies.
    The first line the daemon reports (``ok ...`` or ``error: ...``) goes to ``ready_fd``."""
    from cubefs_fuse.control.keeper import Keeper

    reported = False

    def report(message: str) -> None:
        nonlocal reported
        if ready_fd is not None and not reported:
            try:
                os.write(ready_fd, (message + "\n").encode())
            except OSError:
                pass  # the parent is gone (interrupted): keep serving, it can be unmounted as usual
            finally:
                os.close(ready_fd)
        reported = True

    try:
        # Detached, the parent checked and warned already: the warning is said once.
        config = _load_and_check(config_path, warn=ready_fd is None)
    except ConfigError as exc:
        report(f"error: {exc}")
        raise
    _setup_logging(config, detached=ready_fd is not None)
    keeper = Keeper(os.path.abspath(config_path), config.mount_point,
                    mounts.control_socket_path(config.vol_name, config.control_socket), report,
                    ["--detached"] if ready_fd is not None else [])
    code = keeper.run()
    report("")  # a daemon that ended without a word: the parent says how it exited
    return code


def _idle(idle: bool) -> None:
    """This process runs only when a CPU has nothing else to do (SCHED_IDLE), or as any other
    again.  Root only: an unprivileged process may not take the normal policy back."""
    if os.geteuid() == 0:
        # Every thread: the imports start some (numpy's BLAS pool), which took the policy.
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(thread), os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))


def _serve(config_path: str, channel_fd: int, role: str, detached: bool) -> int:
    """The daemon, run by its keeper over ``channel_fd``: ``role`` "start" mounts, "take-over"
    takes the mount from the running daemon, "recover" serves a dead daemon's (started in
    advance: a standby, which imports what it needs, then waits for the keeper's word)."""
    standby = role == "recover"
    if standby:
        _idle(True)  # ~1 s of CPU to import, which the serving daemon and training need more
    import trio  # imported here so that `--help` stays fast

    from cubefs_fuse import daemon
    from cubefs_fuse.control.keeper import Link

    link = Link(channel_fd)
    try:
        recovery = None
        if standby:
            link.standing_by()  # the imports above are most of a start: done
            recovery = link.recovery()
            if recovery is None:
                return 0  # a standby the keeper no longer needs
            _idle(False)
        journal = link.journal_to_continue() if role == "take-over" else None
        config = _load_and_check(config_path, warn=False, take_over=role != "start")
        _setup_logging(config, detached=detached)
        trio.run(lambda: daemon.run(config, config_path=config_path, on_ready=link.ready,
                                    take_over=role == "take-over", keeper=link, recovery=recovery,
                                    journal=journal))
    except Exception as exc:  # report why the mount failed instead of a silent exit
        # Errors raised inside the daemon's nurseries arrive wrapped in exception groups.
        cause = sole_exception(exc)
        link.failed(str(cause))
        if isinstance(cause, ConfigError):
            print(f"{PROG}: error: {cause}", file=sys.stderr)
            return 2
        log.exception("daemon failed")
        return 1
    return 0


# -- umount --------------------------------------------------------------------------


def cmd_umount(args: argparse.Namespace) -> int:
    if (args.mount_point is None) == (args.config is None):
        raise UserError("give either MOUNTPOINT or -c CONFIG")
    mount_point = os.path.abspath(args.mount_point or load_config(args.config).mount_point)
    entry = mounts.find_mount(mount_point)
    info = mounts.registered(mount_point)
    if entry is None:
        if info is not None and not _alive(info) and _remove_leftovers(mount_point, info):
            print(f"{PROG}: {mount_point} was not mounted; removed the files its daemon (pid {info.get('pid')}) "
                  "left behind")
            return 0
        raise UserError(f"{mount_point} is not mounted")
    if entry.fstype != f"fuse.{mounts.FUSE_SUBTYPE}":
        raise UserError(f"{mount_point} is not a cubefs-fuse mount ({entry.fstype})")
    command = ["fusermount3", "-u"] + (["-z"] if args.lazy else []) + [mount_point]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().removeprefix("fusermount3: ") or f"fusermount3 exited {result.returncode}"
        hint = " (files are open: close them or use --lazy)" if "busy" in reason else ""
        print(f"{PROG}: error: {reason}{hint}", file=sys.stderr)
        return 1
    pid = info.get("pid") if info else None
    if isinstance(pid, int) and not mounts.wait_for_exit(pid, args.timeout):
        print(f"{PROG}: warning: unmounted, but daemon pid {pid} is still running after {args.timeout:.0f} s",
              file=sys.stderr)
        return 1
    if info is not None:
        _remove_leftovers(mount_point, info)  # a crashed daemon cleaned nothing up
    print(f"{PROG}: unmounted {mount_point}")
    return 0


def _alive(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    return isinstance(pid, int) and mounts.pid_alive(pid)


def _remove_leftovers(mount_point: str, info: dict[str, Any]) -> bool:
    """Remove what a dead daemon left (its registry entry, control and data sockets, token
    file, volume file); only what is provably its own: a socket nobody listens on, a
    regular file in our runtime directory, a volume file naming its pid.  True if the
    registry entry was there to remove."""
    pid = info.get("pid")
    if not isinstance(pid, int) or mounts.pid_alive(pid):
        return False
    control = info.get("controlSocket")
    sockets = [control, mounts.data_socket_path(control), mounts.handover_socket_path(control),
               keeper_socket_path(control)] if isinstance(control, str) and control else []
    for path in sockets:  # entries of older versions name no dataSocket: it is derived
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode) and not mounts.socket_in_use(path):
                os.unlink(path)
    token = info.get("tokenFile")
    if isinstance(token, str) and os.path.dirname(token) == mounts.runtime_dir():
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(token).st_mode):
                os.unlink(token)
    vol, config_dir = info.get("volName"), info.get("configDir")
    if isinstance(vol, str) and isinstance(config_dir, str) and config_dir:
        volfile.remove(vol, config_dir, pid)
    mounts.unregister(mount_point, pid)
    return mounts.registered(mount_point) is None


# -- example-config ------------------------------------------------------------------


def cmd_example_config(args: argparse.Namespace) -> int:
    if args.name not in EXAMPLES:
        raise UserError(f"no example config {args.name!r}; choose one of: {', '.join(EXAMPLES)}")
    text = resources.files("cubefs_fuse").joinpath("examples", f"{args.name}.json").read_text(encoding="utf-8")
    sys.stdout.write(text)
    return 0
