"""The background side of cube_torch: finds the daemon, registers the dataset and job,
submits plans. All daemon traffic runs in one background thread of the training process,
never in the training loop, so an absent, slow or failing daemon costs the loop nothing;
each kind of failure is logged once per process as a warning, and the thread exits after
``IDLE_EXIT`` idle seconds and is started again on demand."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cube_torch import progress, shared
from cube_torch.files import SampleFiles, Unsupported, relative_to_mount, sample_files
from cubefs_fuse.control.protocol import (CONFIG_DIR_ENV, CONFIG_FILE_PREFIX, ControlClient, ProtocolError,
                                          VolumeConfig, config_file_path, default_config_dir, read_volume_config)

log = logging.getLogger("cube_torch")

# Seconds a control request may take before cube_torch gives up on it (training never
# waits for it; a slower daemon only delays its own prefetch).
REQUEST_TIMEOUT = 5.0
# The background thread exits after this many idle seconds (and restarts on demand).
IDLE_EXIT = 30.0
# While an epoch is being read, how often the background thread looks whether the daemon
# was replaced (an upgrade hands the mount to a new daemon; a restart starts one): the
# volume file then names another pid, and the new daemon knows no plan, so the rest of
# each epoch is sent again.  One read of a small file per second.
WATCH_EVERY = 1.0
# Pending plans kept per process; a loader's older one is superseded by its newest epoch
# anyway (when full, that is dropped first; else the oldest of all).
MAX_PENDING = 4
# The one synchronous request: registering the job before the first epoch's first index
# is handed out, so the daemon attributes that epoch's very first opens to the job.  It
# is a tiny request; this bounds the wait (once per process and daemon) if the daemon is
# slow, and a missing daemon costs nothing (no config file, no wait).
JOB_REGISTRATION_TIMEOUT = 0.5
# The wait for an epoch's plan to reach the daemon before the loader hands out its first
# index (so no worker opens a file the daemon has not been told about).  A plan of a
# registered dataset is one request of a few ms; the first epoch of a large dataset also
# registers its file list and may take longer: after 1 s it finishes in the background.
PLAN_SUBMIT_WAIT = 1.0


@dataclass
class PlanRequest:
    vol_name: str
    dataset: Any
    order: np.ndarray  # sample indices in the exact order the loader will consume them
    epoch: int
    rank: int
    job: str
    world_size: int = 1  # ranks in the job: the hit-rate line names the rank when > 1
    loader: str = "0"  # which DataLoader of the process (cube_torch.patch.loader_id): its own plan
    first: int = 0  # samples the loader asks for as soon as it starts (its workers' first batches)
    reads: progress.EpochReads | None = None  # the epoch's files read, once its files are known
    handled: threading.Event = field(default_factory=threading.Event)  # set once sent (or given up)


@dataclass(frozen=True)
class JobIdentity:
    """Who the last plan was sent as, for the reporter."""

    job: str
    rank: int
    world_size: int
    vol_name: str


@dataclass
class _DatasetFiles:
    """A dataset's in-mount files, flattened, with each sample's range."""

    paths: list[str]
    offsets: np.ndarray  # sample i reads paths[offsets[i]:offsets[i+1]]
    mount_point: str  # the paths are relative to it
    registered: dict[tuple[int, str], str]  # (daemon pid, socket) -> dataset id
    outside_root: str = ""  # where the files outside the mount lie (their common directory)


_warned: set[str] = set()
_lock = threading.Lock()


def once(kind: str) -> bool:
    """True the first time ``kind`` is asked for in this process (one line per kind of trouble)."""
    with _lock:
        if kind in _warned:
            return False
        _warned.add(kind)
        return True


def warn_once(kind: str, message: str, *args: Any) -> None:
    if not once(kind):
        return
    log.warning("cube_torch: " + message + " (training continues without prefetch; logged once)", *args)


def info_once(kind: str, message: str, *args: Any) -> None:
    if not once(kind):
        return
    log.info("cube_torch: " + message, *args)


def warn_once_in_tree(kind: str, message: str, *args: Any) -> bool:
    """One warning for ``kind`` per process tree (the training process and its forked
    DataLoader workers: cube_torch/shared.py); True if this call logged it."""
    if not once(kind) or not shared.first_in_tree(kind):
        return False
    log.warning("cube_torch: " + message + " (training continues without the daemon's help; logged once)", *args)
    return True


# Volumes named in the "no daemon" warning: a node serves a few; more are summed up.
MAX_VOLUMES_LISTED = 10


def served_volumes(config_dir: str | None = None) -> list[str]:
    """The volumes whose daemon wrote its per-volume file in ``config_dir`` (the
    directory cube_torch looks in): the daemons of this node that take plans."""
    try:
        names = os.listdir(config_dir or default_config_dir())
    except OSError:
        return []
    return sorted(n[len(CONFIG_FILE_PREFIX):] for n in names if n.startswith(CONFIG_FILE_PREFIX)
                  and not n.endswith(".tmp") and len(n) > len(CONFIG_FILE_PREFIX))


def warn_no_volume(vol_name: str, exc: ProtocolError, config_dir: str | None = None) -> bool:
    """``read_volume_config(vol_name)`` failed: say why, once per process tree.  A missing
    file is a wrong VOL_NAME or a mount without ai_prefetch: the warning lists the volumes
    served here and what a mount needs; any other refusal (the file's owner, mode) is said
    as the reader put it."""
    path = config_file_path(vol_name, config_dir)
    if os.path.lexists(path):
        return warn_once_in_tree(f"volume-file:{vol_name}", "%s", exc.message)
    volumes = served_volumes(config_dir)
    listed = ", ".join(repr(v) for v in volumes[:MAX_VOLUMES_LISTED])
    if len(volumes) > MAX_VOLUMES_LISTED:
        listed += f" and {len(volumes) - MAX_VOLUMES_LISTED} more"
    where = config_dir or default_config_dir()
    return warn_once_in_tree(
        f"no-volume:{vol_name}",
        "VOL_NAME=%r: no cubefs-fuse daemon serves this volume on this node (no %s). Volumes served here: %s. "
        "A mount writes that file only with \"profile\": \"ai_prefetch\" in its client config, into its configDir, "
        "which must be where cube_torch looks (%s: $%s, else /tmp)",
        vol_name, path, listed or "none", where, CONFIG_DIR_ENV)


def daemon_not_running(socket_path: str) -> str | None:
    """Why nothing answers at ``socket_path`` when no daemon runs there (the socket is gone,
    or refuses connections: its daemon died), else None (it is up, or slow, or refusing us)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A Unix connect() answers at once (accepted, refused, gone, or EAGAIN for a full
    # backlog); the bound only guards against the unexpected, like the job registration's.
    sock.settimeout(JOB_REGISTRATION_TIMEOUT)
    try:
        sock.connect(socket_path)
    except FileNotFoundError:
        return "is gone"
    except ConnectionRefusedError:
        return "refuses connections"
    except OSError:
        return None
    finally:
        sock.close()
    return None


def warn_if_daemon_down(vol_name: str, volume: VolumeConfig, config_dir: str | None = None) -> bool:
    """True (and one warning per process tree) when the volume's daemon is not running:
    its file names a control socket nobody listens on."""
    reason = daemon_not_running(volume.control_socket)
    if reason is None:
        return False
    warn_once_in_tree(f"daemon-down:{vol_name}",
                      "the cubefs-fuse daemon of volume %r is not running: %s names pid %d, whose socket %s %s; "
                      "see 'cubefs-fuse status' and mount the volume again",
                      vol_name, config_file_path(vol_name, config_dir), volume.pid, volume.control_socket, reason)
    return True


def _job_name(name: str) -> str:
    """A name the daemon accepts: other characters become ``_``, at most 128 of them."""
    return "".join(c if c.isalnum() or c in "_.:@-" else "_" for c in name)[:128]


def _host_pid() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# The key under which the ranks of one process group agree on their job name, in the
# group's own store (next to torch's keys; the prefix keeps it apart from them).
STORE_KEY = "cube_torch/job"
# Job names agreed per store: a store lives as long as its process group, so a new group
# (a new run in the same process) asks again.  Weak keys: no store is kept alive by us.
_store_jobs: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _initialized_group() -> Any:
    """``torch.distributed`` once its default process group is initialised, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:
        pass
    return None


def _process_group_job() -> str | None:
    """The job name every rank of the initialised process group agrees on, or None.

    The first rank to ask writes its own ``<host>-<pid>`` into the group's store with a
    compare-and-set; every other rank reads that value back.  The store is created
    anew by every run (it is the rendezvous itself), so consecutive runs that reuse
    MASTER_ADDR:MASTER_PORT still get different names; and it is shared by all nodes,
    so every node's daemon sees the same name.  One round trip to the store, once per
    process and process group.
    """
    dist = _initialized_group()
    if dist is None or dist.get_world_size() <= 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        known = _store_jobs.get(store)
        if known is None:
            agreed = store.compare_set(STORE_KEY, "", _host_pid())
            known = _job_name(agreed.decode() if isinstance(agreed, bytes) else str(agreed))
            _store_jobs[store] = known
        return known
    except Exception as exc:  # a store without compare_set, a private API that moved
        info_once("store-job", "could not agree on a job name through the process group's store (%r): "
                  "naming the job after the rendezvous", exc)
        return None


def _rendezvous_job() -> str | None:
    """A job name from the launcher's environment, for ranks without a process group.

    ``MASTER_ADDR:MASTER_PORT`` names the rendezvous, but a port is reused by the next
    run; the launcher that started the ranks (torchrun's agent, the parent of
    ``torch.multiprocessing.spawn``) is new in every run, so its pid is added.
    """
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port or world_size() <= 1:
        return None
    return _job_name(f"{address}:{port}@{socket.gethostname()}-{os.getppid()}")


def default_job() -> str:
    """The job this process's plans belong to; every rank of one distributed run gets the same.

    In order: ``CUBE_TORCH_JOB``; torchrun's ``TORCHELASTIC_RUN_ID`` (unless ``none``);
    the name the ranks of the initialised process group agreed on in its store; the
    rendezvous (``MASTER_ADDR:MASTER_PORT``) with the launcher's pid; ``<host>-<pid>``.
    """
    for variable in ("CUBE_TORCH_JOB", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(variable)
        if value and value != "none":
            return _job_name(value)
    return _process_group_job() or _rendezvous_job() or _job_name(_host_pid())


def rank() -> int:
    """This process's rank: ``torch.distributed``'s once initialised, else ``$RANK``, else 0."""
    dist = _initialized_group()
    if dist is not None:
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size() -> int:
    """The number of ranks: ``torch.distributed``'s once initialised, else ``$WORLD_SIZE``, else 1."""
    dist = _initialized_group()
    if dist is not None:
        return int(dist.get_world_size())
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class Submitter:
    """One per process: a queue of plan requests and the thread that sends them."""

    def __init__(self) -> None:
        self._queue: queue.Queue[PlanRequest] = queue.Queue(maxsize=MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._files: weakref.WeakKeyDictionary[Any, _DatasetFiles] = weakref.WeakKeyDictionary()
        self._files_by_id: dict[int, _DatasetFiles] = {}  # for datasets that cannot be weakly referenced
        self._jobs: set[tuple[int, str, int]] = set()  # (daemon pid, job, rank) registered
        self._job_attempts: set[tuple[int, str, int]] = set()  # synchronous registrations tried
        self.last_job: JobIdentity | None = None  # of the last plan sent
        self.plans_sent = 0
        self.replans = 0  # epochs' rests sent again to a new daemon
        # The epochs being read, per loader: the plan as the loader made it, the samples a
        # sample store holds, and the daemon (pid) that has the plan.  The thread's own.
        self._epochs: dict[tuple[str, str, int, str], tuple[PlanRequest, np.ndarray | None, int]] = {}
        self._state = threading.Lock()

    def submit(self, request: PlanRequest) -> None:
        # Before the epoch's first sample is asked for: the job's sample-cache hits start here.
        shared.job_started((request.vol_name, request.job, request.rank))
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            dropped = self._supersede(request)
            if dropped is not None:
                dropped.handled.set()
                self._queue.task_done()
            try:
                self._queue.put_nowait(request)
            except queue.Full:
                return
        with self._state:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cube_torch-plans", daemon=True)
                self._thread.start()

    def _supersede(self, request: PlanRequest) -> PlanRequest | None:
        """Take a queued request out for ``request``: the same loader's (its newer epoch
        supersedes it), else the oldest; None if the queue emptied meanwhile."""
        with self._queue.mutex:
            pending: collections.deque[PlanRequest] = self._queue.queue  # the Queue's own storage
            for i, queued in enumerate(pending):
                if (queued.vol_name, queued.job, queued.rank, queued.loader) == \
                        (request.vol_name, request.job, request.rank, request.loader):
                    del pending[i]
                    return queued
            return pending.popleft() if pending else None

    def submit_and_wait(self, request: PlanRequest, timeout: float) -> bool:
        """Queue the plan and wait until the background thread has sent it, at most
        ``timeout`` seconds; True if it was handled in time."""
        self.submit(request)
        return request.handled.wait(timeout)

    def register_job_now(self, vol_name: str, job: str, rank: int) -> None:
        """Register (job, rank) with the volume's daemon before reading starts (bounded)."""
        try:
            volume = read_volume_config(vol_name)
        except ProtocolError:
            return  # no daemon: the background thread warns once
        key = (volume.pid, job, rank)
        with self._state:
            if key in self._jobs or key in self._job_attempts:
                return
            self._job_attempts.add(key)  # one synchronous try per daemon; later ones go in the background
        try:
            ControlClient(volume.control_socket, timeout=JOB_REGISTRATION_TIMEOUT).register_job(job, rank)
        except ProtocolError:
            return
        with self._state:
            self._jobs.add(key)

    def wait_idle(self, timeout: float) -> bool:
        """For tests: wait until every queued plan has been handled."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            watching = self._reading()
            try:
                request = self._queue.get(timeout=WATCH_EVERY if watching else IDLE_EXIT)
            except queue.Empty:
                if not watching:
                    return
                try:
                    self._replan_for_a_new_daemon()
                except Exception as exc:  # never let the thread die on a surprise
                    warn_once("unexpected-replan", "could not plan the epoch again for a new daemon: %r", exc)
                continue
            try:
                # A CachedDataset's store gets the epoch's keys first (its eviction needs them
                # before the epoch's puts); the samples it holds read no file, so the daemon
                # is not asked to prefetch theirs.
                held = None
                try:
                    held = _plan_samples(request.dataset, request.order)
                except Exception as exc:
                    warn_once("unexpected-samples", "could not send the epoch's order to the sample store: %r", exc)
                self._send(request, held)
            except Exception as exc:  # never let the thread die on a surprise
                warn_once("unexpected", "could not submit the epoch plan: %r", exc)
            finally:
                request.handled.set()
                self._queue.task_done()

    def _reading(self) -> bool:
        """Whether an epoch planned with a daemon is still being read (then the thread watches)."""
        for key, (request, _, _) in list(self._epochs.items()):
            if request.reads is None or request.reads.done:
                del self._epochs[key]
        return bool(self._epochs)

    def _replan_for_a_new_daemon(self) -> None:
        """Send the rest of each epoch being read to a daemon that replaced the one that has
        its plan (the rest: from the samples the training loop has received)."""
        volumes: dict[str, VolumeConfig | None] = {}  # each volume's file read once per look
        for key, (request, held, pid) in list(self._epochs.items()):
            if request.vol_name not in volumes:
                try:
                    volumes[request.vol_name] = read_volume_config(request.vol_name)
                except ProtocolError:
                    volumes[request.vol_name] = None  # between daemons, or none: look again
            volume = volumes[request.vol_name]
            if volume is None or volume.pid == pid:
                continue
            assert request.reads is not None  # only such epochs are watched
            start = request.reads.received()
            rest = dataclasses.replace(request, order=request.order[start:], first=0, reads=None,
                                       handled=threading.Event())
            info_once(f"replan:{request.vol_name}:{volume.pid}",
                      "the cubefs-fuse daemon of volume %r was replaced (pid %d, then %d): sending it the rest "
                      "of the epoch's plan (%d samples)", request.vol_name, pid, volume.pid, len(rest.order))
            if self._send(rest, held[start:] if held is not None else None, original=(request, held)):
                self.replans += 1

    def _send(self, request: PlanRequest, held: np.ndarray | None,
              original: tuple[PlanRequest, np.ndarray | None] | None = None) -> bool:
        """Send the plan (``held``: the samples a sample store holds, whose files will not
        be read), and tell the epoch's progress counter how many files each position reads;
        True if the daemon has it.  ``original``: the epoch's plan ``request`` is the rest of."""
        try:
            volume = read_volume_config(request.vol_name)
        except ProtocolError as exc:
            warn_no_volume(request.vol_name, exc)
            return False
        client = ControlClient(volume.control_socket, timeout=REQUEST_TIMEOUT)
        files = self._dataset_files(request.dataset, volume.mount_point)
        if files is None:
            return False
        planned, planned_held = original or (request, held)
        if request.reads is not None:
            per_position = files.offsets[request.order + 1] - files.offsets[request.order]
            request.reads.set_files(per_position if held is None else np.where(held, 0, per_position))
        if held is not None:
            request = _without_held(request, held)
        if not files.paths:
            if files.outside_root:
                warn_once_in_tree(f"outside:{files.outside_root}:{volume.mount_point}",
                                  "the files of %s lie under %s, outside the mount %s of volume %r: they are read "
                                  "directly, without prefetch; read the dataset through the mount (or unset VOL_NAME)",
                                  type(request.dataset).__name__, files.outside_root, volume.mount_point,
                                  request.vol_name)
            return False
        try:
            key = (volume.pid, volume.control_socket)
            dataset_id = files.registered.get(key)
            if dataset_id is None:
                dataset_id = client.register_dataset(files.paths)
                files.registered[key] = dataset_id
            job_key = (volume.pid, request.job, request.rank)
            if job_key not in self._jobs:
                # No pid: the daemon takes ours from SO_PEERCRED, translated into its own pid
                # namespace (os.getpid() would be wrong from a container).
                client.register_job(request.job, request.rank)
                self._jobs.add(job_key)
            order = _file_order(files.offsets, request.order)
            if not len(order):
                return False  # none of this epoch's samples reads a file on the mount
            dtype = "<u4" if len(files.paths) < 2**32 else "<u8"
            # The daemon answers once the files of the first batches are local (bounded).
            first = len(_file_order(files.offsets, request.order[:request.first])) if request.first else 0
            client.submit_plan(request.job, request.rank, request.epoch, dataset_id,
                               order.astype(dtype).tobytes(), dtype, loader=request.loader, first=first)
            self.last_job = JobIdentity(request.job, request.rank, request.world_size, request.vol_name)
            self.plans_sent += 1
            if planned.reads is not None:  # watched while it is read, in case the daemon is replaced
                self._epochs[(planned.vol_name, planned.job, planned.rank, planned.loader)] = \
                    (planned, planned_held, volume.pid)
            return True
        except ProtocolError as exc:
            if exc.status == 404:
                files.registered.clear()  # the daemon restarted and forgot the list: next epoch re-registers
                self._jobs.clear()
            if exc.status == 0 and warn_if_daemon_down(request.vol_name, volume):
                return False
            warn_once(f"daemon-error:{exc.status}", "the cubefs-fuse daemon refused the plan: %s", exc)
            return False

    def _dataset_files(self, dataset: Any, mount_point: str) -> _DatasetFiles | None:
        try:
            cached = self._files.get(dataset)
        except TypeError:
            cached = self._files_by_id.get(id(dataset))
        if cached is not None and cached.mount_point == mount_point:
            return cached
        try:
            mapping = sample_files(dataset)
        except Unsupported as exc:
            info_once(f"unsupported:{type(dataset).__name__}", "%s: not prefetching it", exc)
            return None
        files = _collect(mapping, len(dataset), mount_point)
        try:
            self._files[dataset] = files
        except TypeError:
            self._files_by_id[id(dataset)] = files
        return files


def _plan_samples(dataset: Any, order: np.ndarray) -> np.ndarray | None:
    """Each CachedDataset (``cube_torch_cached``) read in ``order``, directly or through
    ``Subset``s and ``ConcatDataset``s (nested): send its store the epoch's keys (the
    indices into that CachedDataset, in the order they will be read); which of the order's
    samples the stores hold (a bool each), when one of them says (the samples of a part
    that is no CachedDataset, or whose store does not say, count as not held)."""
    parts: dict[int, tuple[Any, list[np.ndarray], list[np.ndarray]]] = {}
    _cached_parts(dataset, np.arange(len(order)), np.asarray(order, dtype=np.int64), parts)
    held: np.ndarray | None = None
    for cached, positions, keys in parts.values():
        # A CachedDataset met twice (ConcatDataset([ds, ds])): one plan, its keys in reading order.
        where = np.concatenate(positions)
        sorted_by_position = np.argsort(where, kind="stable")
        where, wanted = where[sorted_by_position], np.concatenate(keys)[sorted_by_position]
        answer = cached.plan(wanted)
        if isinstance(answer, np.ndarray) and answer.shape == wanted.shape:
            if held is None:
                held = np.zeros(len(order), dtype=bool)
            held[where] = answer.astype(bool, copy=False)
    return held


def _cached_parts(dataset: Any, positions: np.ndarray, keys: np.ndarray,
                  out: dict[int, tuple[Any, list[np.ndarray], list[np.ndarray]]]) -> None:
    """Walk ``dataset`` read at ``keys`` (its indices; ``positions``: where each is in the
    epoch's order) down to its CachedDatasets; each one's positions and keys into ``out``
    (by object).  Other wrappers are not followed: their stores get no plan and evict least
    recently used first."""
    from torch.utils.data import ConcatDataset, Subset

    while isinstance(dataset, Subset):
        keys = np.asarray(dataset.indices, dtype=np.int64)[keys]
        dataset = dataset.dataset
    if isinstance(dataset, ConcatDataset):
        keys = np.where(keys < 0, keys + len(dataset), keys)  # ConcatDataset's own reading of a negative index
        cumulative = np.asarray(dataset.cumulative_sizes, dtype=np.int64)
        owner = np.searchsorted(cumulative, keys, side="right")
        for part, inner in enumerate(dataset.datasets):
            mine = owner == part
            if mine.any():
                start = int(cumulative[part - 1]) if part else 0
                _cached_parts(inner, positions[mine], keys[mine] - start, out)
        return
    if getattr(type(dataset), "cube_torch_cached", False) and callable(getattr(dataset, "plan", None)):
        entry = out.setdefault(id(dataset), (dataset, [], []))
        entry[1].append(positions)
        entry[2].append(keys)


def _without_held(request: PlanRequest, held: np.ndarray) -> PlanRequest:
    """The request with the samples the store holds left out of its order (their files
    will not be read).  When it holds them all, the first sample stays: the daemon takes no
    empty plan, and this one replaces the loader's previous epoch's plan all the same."""
    order = request.order[~held]
    if not len(order):
        order = request.order[:1]
    return dataclasses.replace(request, order=order)


# Files outside the mount whose directories name the dataset's root in the warning: a
# sample of them (the first ones) is enough to find the common directory.
OUTSIDE_SAMPLE = 1000


def _collect(mapping: SampleFiles, samples: int, mount_point: str) -> _DatasetFiles:
    paths: list[str] = []
    outside: list[str] = []
    offsets = np.zeros(samples + 1, dtype=np.int64)
    for i in range(samples):
        for path in mapping(i):
            relative = relative_to_mount(path, mount_point)
            if relative:
                paths.append(relative)
            elif relative is None and len(outside) < OUTSIDE_SAMPLE:
                outside.append(os.path.dirname(os.path.abspath(path)))
        offsets[i + 1] = len(paths)
    root = os.path.commonpath(outside) if outside else ""
    return _DatasetFiles(paths, offsets, mount_point, {}, root)


def _file_order(offsets: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """The file indices read when the samples are read in order (vectorised)."""
    starts = offsets[samples]
    counts = offsets[samples + 1] - starts
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # Each sample's run starts at its first file; within a run the index counts up.
    run_starts = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return run_starts + np.arange(total, dtype=np.int64)


# The process's one submitter: the patch hands it plans, the reporter asks it for the last job.
submitter = Submitter()
