"""The daemon: builds the components inside one nursery (backend, disk tier, RAM tier, block
cache, metadata cache, filesystem, prefetch service, control server), mounts, reports
readiness only once the mount is live, serves until unmount or SIGINT/SIGTERM, then tears
down in reverse: the FUSE loop ends, the mount is removed, pending NVMe writes drain
(bounded) and the disk tier writes its index for a fast restart."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from cubefs_fuse import __version__, mounts, sdnotify
from cubefs_fuse.backends.deadline import DeadlineBackend
from cubefs_fuse.backends.localdir import raise_fd_limit
from cubefs_fuse.cache.blockcache import BlockCache
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.config import ClientConfig, record_block_size, user_allow_other
from cubefs_fuse.control.dataplane import DataPlane
from cubefs_fuse.control.sampleplane import SamplePlane
from cubefs_fuse.control.routes import Routes
from cubefs_fuse.control.server import AccessPolicy, ControlServer
from cubefs_fuse.errors import ConfigError, sole_exception
from cubefs_fuse.control import handover, keeper as keeping, volfile
from cubefs_fuse.prefetch.batches import BatchResolver
from cubefs_fuse.prefetch.service import PrefetchService
from cubefs_fuse.control.protocol import VolumeConfig
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.fs import journal as journals, session as kernel
from cubefs_fuse.fs.inodes import InodeTable
from cubefs_fuse.fs.metadata import MetadataCache
from cubefs_fuse.metrics import DaemonCollector, MountInfo, Snapshot, start_exporter
from cubefs_fuse.samples.store import SampleStore
from cubefs_fuse.sources import source_backend
from cubefs_fuse.stats import AppReads, app_reads

log = logging.getLogger(__name__)

# A request Python has not answered after this many backendTimeouts is answered EIO by the
# C session: one request may legitimately wait on a few backend operations in turn (a
# lookup's stat, then its small-file read; a read's block behind a fetch slot), each cut
# at backendTimeout by DeadlineBackend, but past four the trio thread is stalled, and the
# mount's readers must not hang with it.
STALLED_AFTER_TIMEOUTS = 4
# How often the inode journal is looked at for a compaction (fs/journal.py): it grows by
# ~130 bytes per inode created, so at a few thousand new inodes a second a look every
# ten seconds lets it grow by a few MB at most past its bound.
JOURNAL_CHECK_EVERY = 10.0
# How long shutdown waits for queued NVMe writes before giving up on them (the next
# start then rescans the directory instead of reading the index).
DRAIN_SECONDS = 10.0


@dataclass
class Daemon:
    config: ClientConfig
    backend: DeadlineBackend
    disk: DiskTier
    cache: BlockCache
    meta: MetadataCache
    fs: Filesystem
    service: PrefetchService | None = None
    data_plane: DataPlane | None = None  # the fast path's transport (ai_prefetch)
    samples: SampleStore | None = None  # the processed-sample cache's store (ai_prefetch)

    async def snapshot(self) -> Snapshot:
        c, plane = self.config, self.data_plane
        await self.fs.settle()  # the reads the FUSE session served count too
        return Snapshot(self.fs.statistics(), self.cache.statistics(), self.backend.statistics(),
                        self.meta.statistics(), self.service.job_samples() if self.service else (),
                        mount=MountInfo(c.vol_name, c.mount_point, c.source, c.profile),
                        fastpath=plane.resolver.statistics() if plane else None,
                        fastpath_connections=plane.connections if plane else 0,
                        samples=self.samples.statistics() if self.samples else None)

    def app_reads(self) -> AppReads:
        """What applications read, every path this daemon serves (the metrics' snapshot
        counts the same figures).  Its callers (status) settle the session's reports first."""
        plane = self.data_plane
        return app_reads(self.fs.statistics(), plane.resolver.statistics() if plane else None,
                         self.samples.statistics() if self.samples else None)


def mount_options(config: ClientConfig) -> set[str]:
    options = {"default_permissions",  # the kernel checks modes: no ACCESS request reaches us
               "ro", "noatime", f"fsname=cubefs-fuse:{config.vol_name}", f"subtype={mounts.FUSE_SUBTYPE}"}
    if os.geteuid() == 0 or user_allow_other():
        options.add("allow_other")  # training jobs run as other users than the daemon
    else:
        log.info("mounting without allow_other (add user_allow_other to /etc/fuse.conf): "
                 "only uid %d can read the mount", os.geteuid())
    return options


async def run(config: ClientConfig, *, config_path: str, on_ready: Callable[[str], None],
              take_over: bool = False, keeper: keeping.Link | None = None,
              recovery: keeping.Recovery | None = None, journal: int | None = None) -> None:
    """Serve the mount until it is unmounted, a signal arrives or a successor takes it over
    (control/handover.py); ``on_ready`` is told once it is served.  ``take_over``: the mount is
    served by a running daemon now, which hands it over.  ``keeper``: the parent process that
    keeps the connection and the inode journal for a recovery (control/keeper.py), and is
    told how serving ended; ``recovery``: the mount of a daemon that died, to serve on;
    ``journal``: the inode journal of the daemon whose mount is taken over, to continue."""
    raise_fd_limit()
    # Every backend operation has a deadline (docs/concurrency.md, "Never stuck"): a hung remote
    # costs readers EIO, never a stuck process or an unmountable mount.
    backend = DeadlineBackend(source_backend(config), config.backend_timeout)
    try:
        predecessor = await handover.take_over(handover_socket_path(config)) if take_over else None
        adopted = predecessor.adopted if predecessor is not None else None
        while True:
            try:
                outgoing = await _run_once(config, config_path, on_ready, backend, adopted, predecessor,
                                           _Kept(keeper, recovery, journal if predecessor is not None else None))
            except BaseException as exc:
                if predecessor is not None and not predecessor.answered:
                    with trio.CancelScope(shield=True):  # the old daemon serves on: it must hear so
                        await predecessor.answer(False, str(sole_exception(exc)) or type(exc).__name__)
                raise  # (the descriptor handed over closes with the process)
            if outgoing is None:
                if keeper is not None:
                    keeper.bye(handed_over=False)
                return
            # Handed over: this daemon exits, unless the successor failed (then it serves on).
            adopted, predecessor, recovery = await outgoing.complete(), None, None
            if adopted is None:
                if keeper is not None:
                    keeper.bye(handed_over=True)
                return
            on_ready = _reported_already
    finally:
        backend.close()


def _reported_already(_: str) -> None:
    pass


@dataclass(frozen=True)
class _Kept:
    """The keeper of this daemon's mount (None: none, the daemon run without one) and the
    dead daemon's mount it recovers, if it does."""

    keeper: keeping.Link | None
    recovery: keeping.Recovery | None
    journal: int | None  # the journal of the daemon whose mount this one takes over


async def _run_once(config: ClientConfig, config_path: str, on_ready: Callable[[str], None],
                    backend: DeadlineBackend, adopted: handover.Adopted | None,
                    predecessor: handover.Predecessor | None, kept: _Kept) -> handover.Outgoing | None:
    """Open the NVMe tier, build, serve, close it; what to hand over if a successor asked."""
    disk = await DiskTier.open(config.cache_dir, config.disk_cache_size, config.disk_free_ratio)
    record_block_size(config)
    served = _Served()
    # What start-up leaves in shared places (the token file) is undone here, whether the
    # daemon stops normally or fails half-way: nothing outlives it.
    cleanup = contextlib.ExitStack()
    try:
        with cleanup:
            await _build_and_serve(config, config_path, on_ready, backend, disk, cleanup, adopted, predecessor,
                                   served, kept)
    finally:
        await _close_disk(disk, served.write_index)
    return served.outgoing


@dataclass
class _Served:
    """How serving ended: whether the NVMe index is exact, and a handover to complete."""

    write_index: bool = False
    outgoing: handover.Outgoing | None = None


async def _build_and_serve(config: ClientConfig, config_path: str, on_ready: Callable[[str], None],
                           backend: DeadlineBackend, disk: DiskTier, cleanup: contextlib.ExitStack,
                           adopted: handover.Adopted | None, predecessor: handover.Predecessor | None,
                           served: _Served, kept: _Kept) -> None:
    """The components in one nursery, then mount (or adopt) and serve."""
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.supervise)
        cache = BlockCache(nursery, MemoryTier(config.mem_cache_size), disk,
                           fetch_slots=config.backend_threads, prefetch_slots=config.prefetch_threads)
        meta = MetadataCache(backend, attr_ttl=config.attr_valid, lookup_ttl=config.lookup_valid,
                             max_entries=config.meta_cache_entries)
        fs = Filesystem(nursery, meta, cache, backend, block_size=config.block_size,
                        outage=backend if config.stale_if_error else None)
        daemon = Daemon(config, backend, disk, cache, meta, fs)
        # The control API is always there (status, stats, warmup, drop-cache work on any
        # mount); ai_prefetch adds jobs, plans, hit accounting per job and the volume file.
        service = daemon.service = PrefetchService(nursery, fs, config)
        if config.profile == "ai_prefetch":
            volfile.claim(config.vol_name, config.config_dir)
            fs.observer = service
        if config.profile == "ai_prefetch" and (config.sample_cache_mem_size or config.sample_cache_disk_size):
            daemon.samples = await SampleStore.open(
                nursery, sample_dir(config), config.sample_cache_mem_size, config.sample_cache_disk_size,
                config.disk_free_ratio, shared=frozenset(config.sample_cache_shared))
        daemon.data_plane = await _start_control(nursery, service, config, cleanup, daemon.samples)
        service.reads = daemon.app_reads  # status and stats count every path, as /metrics does
        listener = handover.Listener(handover_socket_path(config))
        await nursery.start(listener.serve)
        await _serve(daemon, config_path, on_ready, adopted, predecessor, listener, served, kept)
        nursery.cancel_scope.cancel()


async def _close_disk(disk: DiskTier, write_index: bool) -> None:
    with trio.CancelScope(shield=True):
        if write_index:
            await disk.close()
        else:
            disk.release()


async def _serve(daemon: Daemon, config_path: str, on_ready: Callable[[str], None], adopted: handover.Adopted | None,
                 predecessor: handover.Predecessor | None, listener: handover.Listener, served: _Served,
                 kept: _Kept) -> None:
    """Mount (or adopt the connection handed over, or the dead daemon's), serve, then
    unmount, or detach for a successor; ``served`` says whether every NVMe write finished
    and what to hand over."""
    config = daemon.config
    recovery = kept.recovery
    if adopted is not None:
        try:
            daemon.fs.restore(adopted.fs)
        except ValueError as exc:
            raise ConfigError(f"the handed-over state cannot be used: {exc}") from None
    elif recovery is not None:
        try:
            replayed = await trio.to_thread.run_sync(journals.read, recovery.journal_fd)
        except (OSError, journals.JournalError) as exc:
            os.close(recovery.journal_fd)
            raise ConfigError(f"the dead daemon's inode journal cannot be used: {exc}") from None
        daemon.fs.recover(replayed)
    # Every inode from here on is written to the journal before the kernel can learn of it:
    # the dead or handing daemon's, continued (it describes the table rebuilt from it or
    # handed over already), else a new one.
    journal = None if kept.keeper is None else _journal(daemon.fs.inodes, recovery.journal_fd if recovery is not None
                                                       else kept.journal if adopted is not None else None)
    daemon.fs.inodes.journal = journal
    connection = adopted.connection if adopted is not None else recovery.connection if recovery is not None else None

    def on_init() -> None:
        trio.lowlevel.spawn_system_task(_tune_connection, config.mount_point)
        if kept.keeper is not None and journal is not None:
            kept.keeper.deposit(session.connection(), journal.fd)

    # The connection is tuned once the kernel has processed the answer to its INIT
    # request: that answer sets the readahead to min(current, the daemon's max_readahead
    # = the kernel's own offer, 128 KiB) and would undo a tuning made before it.  The
    # session calls on_init once the INIT answer has been written (fs/_session.c).
    try:
        session = kernel.mount(daemon.fs, config.mount_point, mount_options(config),
                               entry_timeout=config.lookup_valid, attr_timeout=config.attr_valid,
                               request_timeout=STALLED_AFTER_TIMEOUTS * config.backend_timeout,
                               on_init=on_init, adopted=connection)
    except OSError as exc:
        raise ConfigError(f"cannot {'adopt the mount of' if connection else 'mount'} {config.mount_point}: {exc}") from None
    finally:
        if connection is not None:
            os.close(connection[0])  # the session holds its own duplicate
    if connection is not None and kept.keeper is not None and journal is not None:
        kept.keeper.deposit(session.connection(), journal.fd)  # an adopted INIT calls no on_init
    if recovery is not None:
        try:
            session.resend()  # the requests the dead daemon read come again, to this daemon
        except OSError as exc:
            log.error("the kernel cannot send again the requests the dead daemon had read (%s, kernel 6.9 "
                      "or later needed): their readers wait until the mount is unmounted", exc)
    # Until the predecessor is told "ok" the mount is still its: a failure detaches, never unmounts.
    confirmed = predecessor is None
    stop_exporter: Callable[[], None] | None = None

    async def release_exporter() -> None:
        # Stopping it waits for the HTTP server's poll (up to 0.5 s): a handover does it
        # before the readers pause, not during the pause.
        nonlocal stop_exporter
        stop, stop_exporter = stop_exporter, None
        if stop is not None:
            await trio.to_thread.run_sync(stop)

    listener.before_pause = release_exporter
    ai_prefetch = config.profile == "ai_prefetch"
    try:
        if config.exporter_port:
            collector = DaemonCollector(daemon.snapshot, trio.lowlevel.current_trio_token())
            stop_exporter = start_exporter(config.exporter_addr, config.exporter_port, collector)
        # The entry names every file the daemon has in shared places (the data socket is the
        # control socket's name + ".data"): `umount` removes them after a daemon that could
        # not (SIGKILL, a crash).
        mounts.register(config.mount_point, {"volName": config.vol_name, "source": config.source,
                                             "config": os.path.abspath(config_path), "version": __version__,
                                             "controlSocket": control_socket_path(config),
                                             "tokenFile": token_file_path(config) if config.prof_port else "",
                                             "profile": config.profile,
                                             "configDir": config.config_dir if ai_prefetch else "",
                                             "keeper": os.getppid() if kept.keeper is not None else 0})
        if ai_prefetch:
            volume = VolumeConfig(
                prof=config.prof_port or 0, mount_point=config.mount_point, vol_name=config.vol_name,
                local_ip=volfile.local_ip(), control_socket=control_socket_path(config), pid=os.getpid(),
                token_file=token_file_path(config) if config.prof_port else "",
                data_socket=data_socket_path(config))
            # The write ends with an fsync: not on the trio thread, which serves FUSE already.
            written = await trio.to_thread.run_sync(volfile.write, volume, config.config_dir)
            log.info("ai_prefetch: control API on %s, volume config %s", control_socket_path(config), written)
        for key in config.unused_keys:
            log.info("config key %r is a CubeFS setting with no effect here", key)
        log.info("%s %s on %s (volume %s, pid %d)", "serving the mount handed over:" if adopted else
                 "serving the mount of a daemon that died:" if recovery else "mounted",
                 config.source, config.mount_point, config.vol_name, os.getpid())
        async with trio.open_nursery() as nursery:
            # Handle signals before reporting readiness: a SIGTERM sent as soon as `mount`
            # returns must unmount cleanly, not kill the process and leave a dead mount.
            await nursery.start(_terminate_on_signal, daemon.backend, session)
            if journal is not None and kept.keeper is not None:
                nursery.start_soon(_compact_journal, daemon.fs, journal, kept.keeper)
            detail = ""
            if predecessor is not None:
                await predecessor.answer(True)
                confirmed = True
                paused = time.monotonic() - predecessor.paused_at
                detail = f"readers paused {paused * 1000:.0f} ms"
                log.info("took the mount over from the previous daemon: %s", detail)
            elif recovery is not None:
                paused = time.monotonic() - recovery.died_at
                detail = f"readers paused {paused * 1000:.0f} ms"
                log.warning("recovered the mount after daemon pid %d died (%d inodes from its journal): %s",
                            recovery.previous_pid, len(daemon.fs.inodes), detail)
            listener.session = session
            on_ready(detail)
            sdnotify.ready(f"serving {config.source} on {config.mount_point}")
            await session.serve()
            nursery.cancel_scope.cancel()
    finally:
        handing_over = listener.successor is not None
        if handing_over:  # not STOPPING=1: the service goes on, in the successor
            sdnotify.notify(f"STATUS=handing {config.mount_point} over to a new daemon")
        else:
            sdnotify.stopping(f"unmounting {config.mount_point}")
        if handing_over or not confirmed:
            _detach(session, daemon.fs, listener, served)
        else:
            session.close()
        mounts.unregister(config.mount_point)
        if ai_prefetch:
            volfile.remove(config.vol_name, config.config_dir)
        await release_exporter()
        if journal is not None:  # the keeper has its own descriptor of it
            daemon.fs.inodes.journal = None
            journal.close()
        if not handing_over:
            log.info("unmounted %s", config.mount_point)
    with trio.move_on_after(DRAIN_SECONDS):
        await daemon.cache.drain()
        served.write_index = True
        return
    log.warning("NVMe writes still pending after %.0f s; the next start will rescan the cache", DRAIN_SECONDS)


def _journal(table: InodeTable, continued: int | None) -> journals.InodeJournal:
    """The journal ``continued`` (a dead or handing daemon's, which describes ``table``), else a
    new one that starts as a snapshot of ``table`` (and for a journal of another format)."""
    if continued is not None:
        try:
            return journals.InodeJournal(continued, records=len(table))
        except journals.JournalError as exc:
            log.info("a new inode journal: %s", exc)
            os.close(continued)
    return journals.InodeJournal.of(table)


async def _compact_journal(fs: Filesystem, journal: journals.InodeJournal, keeper: keeping.Link) -> None:
    """Rewrite the inode journal once it holds far more records than the table has inodes,
    and give the keeper the new one."""
    while True:
        await trio.sleep(JOURNAL_CHECK_EVERY)
        if journal.worth_compacting(len(fs.inodes)):
            old = await journal.compact(fs.inodes)
            keeper.journal(journal.fd)
            os.close(old)


def _detach(session: kernel.KernelSession, fs: Filesystem, listener: handover.Listener, served: _Served) -> None:
    """Leave the mount in place: for the successor that asked (``served.outgoing``), or for
    the predecessor that still serves it (this daemon failed before taking it over)."""
    successor = listener.successor
    try:
        connection = session.detach()
    except RuntimeError as exc:  # ended otherwise (unmounted meanwhile, or a bug): no handover
        log.error("cannot hand the mount over: %s", exc)
        if successor is not None:
            successor.close()  # the successor hears the end and gives up
        session.close()
        return
    if successor is None:
        os.close(connection[0])  # the predecessor serves on with its own descriptor
        return
    served.outgoing = handover.Outgoing(successor, handover.Adopted(connection, fs.export(), listener.paused_at))


async def _tune_connection(mount_point: str) -> None:
    try:
        mounts.tune_connection(mount_point)  # sysfs and /proc only: in-memory, never the remote
    except Exception:  # a system task must not raise: tuning is best effort
        log.exception("could not tune the FUSE connection of %s", mount_point)


def handover_socket_path(config: ClientConfig) -> str:
    return mounts.handover_socket_path(control_socket_path(config))


def control_socket_path(config: ClientConfig) -> str:
    return mounts.control_socket_path(config.vol_name, config.control_socket)


def data_socket_path(config: ClientConfig) -> str:
    """The fast path's socket (control/dataplane.py), beside the control socket."""
    return mounts.data_socket_path(control_socket_path(config))


def sample_dir(config: ClientConfig) -> str:
    """The sample store's NVMe directory, inside the disk cache's (under its lock)."""
    return os.path.join(config.cache_dir, "samples")


def token_file_path(config: ClientConfig) -> str:
    return mounts.token_file_path(config.vol_name)


def _write_token(path: str, token: str) -> None:
    """The bearer token, 0600, through an unpredictable temp name (O_EXCL|O_NOFOLLOW)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def _start_control(nursery: trio.Nursery, service: PrefetchService, config: ClientConfig,
                         cleanup: contextlib.ExitStack, samples: SampleStore | None = None) -> DataPlane | None:
    """Open the control API (Unix socket, and the loopback port with a token if configured)
    and, with ai_prefetch, the data socket of cube_torch's fast path.
    The token file is removed by ``cleanup`` when the daemon ends, however it ends."""
    token = None
    if config.prof_port:
        token = secrets.token_urlsafe(32)
        path = token_file_path(config)
        _write_token(path, token)
        cleanup.callback(_unlink_quietly, path)  # the token dies with the daemon: no stale secret
    server = ControlServer(AccessPolicy(frozenset(config.control_allow_uids),
                                        frozenset(config.control_allow_gids)), token)
    Routes(service, ai_prefetch=config.profile == "ai_prefetch", samples=samples).install(server)
    socket_path = control_socket_path(config)
    os.makedirs(os.path.dirname(socket_path), exist_ok=True)
    ai_prefetch = config.profile == "ai_prefetch"
    data_plane = DataPlane(BatchResolver(service, allow_other="allow_other" in mount_options(config)),
                           samples=SamplePlane(samples).serve if samples is not None else None) \
        if ai_prefetch else None
    if data_plane is not None:
        service.fs.settle_reports_of(data_plane.settle)  # a status counts releases already sent
    try:
        await nursery.start(server.serve_unix, socket_path)
        if data_plane is not None:
            await nursery.start(server.serve_data, data_socket_path(config), data_plane.serve)
        if config.prof_port:
            await nursery.start(server.serve_tcp, config.prof_port)
    except OSError as exc:
        raise ConfigError(f"cannot open the control API ({socket_path}, profPort {config.prof_port}): "
                          f"{exc.strerror or exc}") from None
    return data_plane


async def _terminate_on_signal(backend: DeadlineBackend, session: kernel.KernelSession, *,
                               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            log.info("%s received: unmounting", signal.Signals(signum).name)
            # Requests waiting on a hung remote end now with EIO, so the FUSE loop (which
            # finishes the requests in flight) ends at once instead of after the deadline.
            backend.abort()
            session.terminate()
            return
