"""Device-side prefetch: ``DevicePrefetcher(loader, device)`` iterates ``loader`` in a
background thread, ``depth`` batches ahead of the training step, and hands out each batch
already on ``device``: copied from pinned memory on a side CUDA stream, the step's stream
waiting on the copy's event (on a CPU device nothing is copied; the rest is the same).
A loader that delivers nothing within ``timeout`` seconds raises :class:`DataStalled`,
saying what stalled; an error the loader raises surfaces at the step that would have used
its batch; how long each step waited for its batch is counted (``cube_torch.waits``)."""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import queue
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cube_torch import waits
from cube_torch.batches import map_tensors, tensors

# A producer whose queue is full looks at the stop flag this often: the thread of a closed
# prefetcher ends within it (a step is rarely shorter than this is noticeable).
PUT_POLL = 0.1
# How long closing waits for the thread to finish the batch it is loading, where stopping
# the loader's workers is not the better choice (persistent workers, which the next epoch
# reuses): torch's own bound for a worker to answer (MP_STATUS_CHECK_INTERVAL).
CLOSE_WAIT = 5.0
# How many wrapping generators (Accelerate's prepared loader, a user's own) are looked
# through for torch's DataLoader iterator when a stall is described or workers stopped.
WRAPPER_DEPTH = 8


class DataStalled(TimeoutError):
    """No batch within the prefetcher's ``timeout``; the message says what stalled."""


class _End:
    """The loader's epoch ended."""


@dataclass
class _Failed:
    """The loader (or the copy) raised this for one batch."""

    error: BaseException


@dataclass
class _Ready:
    batch: Any  # on the device
    event: torch.cuda.Event | None  # recorded on the side stream after the copy and transform
    device_tensors: list[torch.Tensor]  # the batch's tensors on the device (record_stream)
    host: Any = None  # the loader's batch, the copy's source, kept until handed out


_Item = _Ready | _Failed | _End


@dataclass
class _Progress:
    """What the producer does now (for the stall message)."""

    what: str = "loader"  # loader (waiting for a batch) | copy | queue (full) | done
    since: float = field(default_factory=time.monotonic)

    def now(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()


class _Stager(Protocol):
    device: torch.device

    def context(self) -> contextlib.AbstractContextManager[Any]: ...

    def stage(self, host: Any) -> _Ready: ...

    def hand_out(self, ready: _Ready) -> Any: ...


class _CpuStager:
    """Nothing to copy (a tensor on another device is brought to the CPU)."""

    def __init__(self, transform: Callable[[Any], Any] | None) -> None:
        self.device = torch.device("cpu")
        self.transform = transform

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def stage(self, host: Any) -> _Ready:
        batch = map_tensors(host, lambda t: t if t.device.type == "cpu" else t.cpu())
        return _Ready(batch if self.transform is None else self.transform(batch), None, [])

    def hand_out(self, ready: _Ready) -> Any:
        return ready.batch


class _CudaStager:
    """Copies on a side stream; the consumer's stream waits on the copy's event."""

    def __init__(self, device: torch.device, transform: Callable[[Any], Any] | None) -> None:
        self.device = device
        self.transform = transform
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def context(self) -> contextlib.AbstractContextManager[Any]:
        # The whole producer runs on the side stream: a loader that moves batches itself
        # (Accelerate's) copies there too, and the event covers that copy as well.
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor  # already there (a loader that moved it): never copied twice
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        # The pinned source stays valid until the copy ran: torch's pinned-memory allocator
        # records the copy's stream and reuses the block only after it (and _Ready.host
        # holds the loader's own batch until it is handed out).
        return tensor.to(self.device, non_blocking=True)

    def stage(self, host: Any) -> _Ready:
        batch = map_tensors(host, self._copy)
        if self.transform is not None:
            batch = self.transform(batch)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return _Ready(batch, event, [t for t in tensors(batch) if t.device == self.device], host)

    def hand_out(self, ready: _Ready) -> Any:
        current = torch.cuda.current_stream(self.device)
        assert ready.event is not None
        current.wait_event(ready.event)
        for tensor in ready.device_tensors:
            # Allocated on the side stream, used on this one: the allocator must not hand
            # the memory out again before this stream's work on it is done.
            tensor.record_stream(current)
        return ready.batch


def resolve_device(device: torch.device | str | int) -> torch.device:
    """The device batches go to; a clear ValueError for one this machine or the
    prefetcher cannot serve."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"DevicePrefetcher: {device!r} is not a device (e.g. 'cuda', 'cuda:1', 'cpu')") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"DevicePrefetcher moves batches to a cuda or cpu device, not {str(resolved)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"DevicePrefetcher: device {str(resolved)!r} asked for, but torch.cuda.is_available() is "
                         "False here; pass device='cpu' (e.g. 'cuda' if torch.cuda.is_available() else 'cpu')")
    return torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())


def normalize(mean: Sequence[float], std: Sequence[float], *, dtype: torch.dtype = torch.float32,
              channels_last: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """``(x - mean) / std`` per channel (dimension -3 of a CHW or NCHW tensor), computed in
    ``dtype``; ``mean`` and ``std`` in the input's units (0-255 for ``uint8`` images).
    ``channels_last`` lays a 4-d result out NHWC.  For ``DevicePrefetcher(transform=...)``,
    where it runs on the side stream."""
    if not mean or len(mean) != len(std):
        raise ValueError(f"normalize: mean and std need one value per channel each, got {len(mean)} and {len(std)}")
    if any(s == 0 for s in std):
        raise ValueError("normalize: a std of 0 would divide by zero")
    constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(images: torch.Tensor) -> torch.Tensor:
        if images.device not in constants:
            shape = (len(mean), 1, 1)
            constants[images.device] = (torch.tensor(mean, dtype=dtype, device=images.device).view(shape),
                                        torch.tensor(std, dtype=dtype, device=images.device).view(shape))
        m, s = constants[images.device]
        if channels_last and images.dim() == 4:
            images = images.contiguous(memory_format=torch.channels_last)  # before widening: fewer bytes moved
        return (images.to(dtype) - m) / s  # elementwise: keeps the memory format

    return apply


def torch_iterator(source: Any) -> Any:
    """torch's DataLoader iterator behind ``source`` (itself, or held by the generators
    that wrap it), else None."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    try:
        for _ in range(WRAPPER_DEPTH):
            if isinstance(source, _BaseDataLoaderIter):
                return source
            frame = getattr(source, "gi_frame", None)
            if frame is None:
                return None  # not a generator, or one that has finished
            local = list(frame.f_locals.values())
            found = [v for v in local if isinstance(v, _BaseDataLoaderIter)]
            if found:
                return found[0]
            inner = getattr(source, "gi_yieldfrom", None)  # ``yield from`` another iterator
            source = inner if inner is not None else next((v for v in local if inspect.isgenerator(v)), None)
    except Exception:  # a frame that went away meanwhile: nothing to say about it
        return None
    return None


def _workers_said(iterator: Any) -> str | None:
    """Which worker owes the awaited batch, and every worker's state; None without workers."""
    workers = list(getattr(iterator, "_workers", None) or [])
    if not workers:
        return None

    def state(worker: Any) -> str:
        return "alive" if worker.is_alive() else f"exited with code {worker.exitcode}"

    listed = ", ".join(f"{i} (pid {w.pid}, {state(w)})" for i, w in enumerate(workers))
    task = dict(getattr(iterator, "_task_info", {}) or {}).get(getattr(iterator, "_rcvd_idx", -1))
    if isinstance(task, tuple) and len(task) == 1 and 0 <= task[0] < len(workers):
        owner = workers[task[0]]
        said = f"the DataLoader is waiting for it from worker {task[0]} (pid {owner.pid}, {state(owner)})"
        if owner.is_alive():
            said += f", whose dataset or collate_fn has not returned (py-spy dump --pid {owner.pid} shows where)"
    else:
        said = f"none of the DataLoader's {len(workers)} workers has delivered it"
    return f"{said}; workers: {listed}"


# Where Python's and torch's own code lies: a stalled loading thread is described by the
# innermost frame outside them (the dataset's), not by the lock it waits on.
_LIBRARIES = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
                    os.path.dirname(torch.__file__), os.path.dirname(__file__)})


def _where(thread: threading.Thread | None) -> str:
    """Where ``thread`` runs: ``file:line in function`` of its innermost frame outside
    Python's and torch's code, with the innermost one when that differs."""
    innermost = sys._current_frames().get(thread.ident or -1) if thread is not None else None
    if innermost is None:
        return "an unknown place"
    frame: Any = innermost
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    chosen = frame if frame is not None else innermost
    said = f"{chosen.f_code.co_filename}:{chosen.f_lineno} in {chosen.f_code.co_name}"
    if chosen is not innermost:
        said += (f" (now in {os.path.basename(innermost.f_code.co_filename)}:{innermost.f_lineno} "
                 f"in {innermost.f_code.co_name})")
    return said


def _put(out: queue.Queue[_Item], item: _Item, stop: threading.Event) -> bool:
    """Queue ``item`` unless the prefetcher closes first; True if queued."""
    while not stop.is_set():
        try:
            out.put(item, timeout=PUT_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator[Any], stager: _Stager, out: queue.Queue[_Item], stop: threading.Event,
             progress: _Progress) -> None:
    """The background thread: each of the loader's items (a batch, an error, the end),
    staged on the device, in the loader's order.  It holds no reference to the consumer's
    iterator, so dropping that closes the prefetch."""
    try:
        with stager.context():
            while not stop.is_set():
                progress.now("loader")
                try:
                    host = next(source)
                except StopIteration:
                    _put(out, _End(), stop)
                    return
                except BaseException as exc:  # the loader's error: for the step that would use the batch
                    if stop.is_set() or not _put(out, _Failed(exc), stop) or not isinstance(exc, Exception):
                        return
                    continue  # as a DataLoader: the epoch goes on with the next batch
                progress.now("copy")
                try:
                    item: _Item = stager.stage(host)
                except Exception as exc:
                    item = _Failed(exc)
                del host
                progress.now("queue")
                if not _put(out, item, stop):
                    return
    except BaseException as exc:  # the device context itself failed
        _put(out, _Failed(exc), stop)
    finally:
        progress.now("done")
        if inspect.isgenerator(source):  # its own cleanup (a wrapper's DataLoader iterator), in this thread
            with contextlib.suppress(Exception):
                source.close()


def _stop_workers(iterator: Any, loader: Any) -> None:
    """Stop the workers of torch's ``iterator`` as its end would (bounded by torch: each
    worker is joined for 5 s, then terminated); a persistent-workers loader then starts
    new ones at its next epoch."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        # The producer may be waiting in torch's loop for a batch no worker will send now
        # (that loop only notices workers that died on their own): an item it cannot place
        # ends its wait with an error, which a closed prefetcher ignores.
        with contextlib.suppress(Exception):
            iterator._data_queue.put((None, None))
            # A multiprocessing queue flushes puts at exit; this one may be unread by then.
            getattr(iterator._data_queue, "cancel_join_thread", lambda: None)()
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


# Passes whose thread was started, and those threads (a pass dropped unexhausted is closed
# by garbage collection while its thread may still be finishing): closed and joined at exit.
_started: weakref.WeakSet[_Epoch] = weakref.WeakSet()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Stop every pass still running (one a framework left unexhausted, or closed only by
    garbage collection) before the interpreter finalises: a prefetch thread still freeing
    a batch then would die inside torch's tensor destructor, which aborts the process
    (``terminate called without an active exception``) after training finished.
    atexit callbacks run before the final collection and while daemon threads live."""
    for epoch in list(_started):
        epoch.close()
    deadline = time.monotonic() + CLOSE_WAIT
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_close_at_exit)


class _Epoch(Iterator[Any]):
    """One pass over the loader."""

    def __init__(self, loader: Iterable[Any], stager: _Stager, depth: int, timeout: float | None,
                 counter: waits.WaitCounter) -> None:
        self._loader = loader
        self._stager = stager
        self._timeout = timeout
        self._counter = counter
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._progress = _Progress()
        self._handed = 0  # batches handed out (and errors raised) so far
        self._ended = False  # the loader's epoch ended
        self._closed = False
        self._last = 0.0  # the previous hand-out (or the start): a step's start
        self._source: Iterator[Any] | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        """Iterate the loader, from here (its workers start in this thread, as in a plain
        loop).  At the first ``next()``, not at ``iter()``: a framework that calls ``iter()``
        only to check that it can (Lightning does) starts no epoch and draws no order."""
        self._last = time.monotonic()
        self._source = iter(self._loader)
        self._thread = threading.Thread(target=_produce, name="cube_torch-prefetch", daemon=True,
                                        args=(self._source, self._stager, self._queue, self._stop, self._progress))
        self._thread.start()
        _started.add(self)
        _threads.add(self._thread)

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        if self._thread is None:
            self._start()
        asked = time.monotonic()
        try:
            item = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            message = self._stall(time.monotonic() - asked)
            self.close(stalled=True)
            raise DataStalled(message) from None
        got = time.monotonic()
        if isinstance(item, _End):
            self._ended = True
            self.close()
            raise StopIteration
        step, self._last = got - self._last, got
        self._handed += 1
        if isinstance(item, _Failed):
            if not isinstance(item.error, Exception):
                self.close()  # the thread ended with it (an interrupt): nothing follows
            raise item.error
        self._counter.add(got - asked, step)
        waits.process.add(got - asked, step)
        return self._stager.hand_out(item)

    def _stall(self, waited: float) -> str:
        head = f"DevicePrefetcher: no batch within {waited:.1f} s (batch {self._handed} of the epoch, from 0): "
        age = time.monotonic() - self._progress.since
        if self._progress.what == "copy":
            return head + f"its copy to {self._stager.device} (pinning, copy, transform) has taken {age:.1f} s"
        iterator = torch_iterator(self._source)
        said = _workers_said(iterator) if iterator is not None else None
        if said is not None:
            return head + said
        if iterator is not None:
            return (head + "the DataLoader loads batches in this process (num_workers=0) and has been at "
                    f"{_where(self._thread)} for {age:.1f} s")
        return head + f"the loader ({type(self._loader).__name__}) has been at {_where(self._thread)} for {age:.1f} s"

    def close(self, *, stalled: bool = False) -> None:
        """Stop prefetching: the thread ends, a DataLoader's workers are stopped as when a
        plain loop leaves an epoch early (kept, if persistent, unless they stalled)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # a producer waiting to queue wakes up; staged batches are freed
                self._queue.get_nowait()
        source, self._source = self._source, None
        thread = self._thread
        if thread is None or not thread.is_alive():
            return  # never started, or done
        iterator = torch_iterator(source)
        if iterator is None:
            return  # the thread ends once the loader's current batch is there
        if not stalled and (self._ended or getattr(iterator, "_persistent_workers", False)):
            thread.join(CLOSE_WAIT)
            if not thread.is_alive():
                return
        _stop_workers(iterator, self._loader)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # also at interpreter exit
            self.close()


class DevicePrefetcher:
    """``loader``'s batches on ``device``, ``depth`` batches ahead of the step.

    Iterate it where the loader was iterated, once per epoch (``set_epoch`` of a
    ``DistributedSampler`` as usual): each ``iter()`` iterates the loader once, so the
    sampler's order and cube_torch's epoch plan are the loader's own.  Tensors nested in
    tuples, lists, dicts and dataclasses are copied; other values pass through; a tensor
    already on ``device`` is not copied again.  ``transform(batch)`` runs on the device
    batch, on the side stream (e.g. ``normalize``).  ``timeout`` (seconds): a batch later
    than that raises :class:`DataStalled`, and the epoch's workers are stopped.  A new
    ``iter()`` ends the previous pass.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str | int, depth: int = 2,
                 timeout: float | None = None, transform: Callable[[Any], Any] | None = None) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"DevicePrefetcher needs an iterable loader (a DataLoader), not {type(loader).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"DevicePrefetcher: depth is a number of batches, 1 or more, not {depth!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"DevicePrefetcher: timeout is a number of seconds above 0 (or None), not {timeout!r}")
        self.loader = loader
        self.device = resolve_device(device)
        self.depth = depth
        self.timeout = None if timeout is None else float(timeout)
        self.transform = transform
        self._counter = waits.WaitCounter()
        self._stager: _Stager | None = None  # made on first use: a CUDA stream needs the device
        self._current: weakref.ref[_Epoch] | None = None

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"{type(self.loader).__name__} has no len(), so neither has its DevicePrefetcher") from None

    def __iter__(self) -> Iterator[Any]:
        previous = self._current() if self._current is not None else None
        if previous is not None:
            previous.close()
            previous.join(CLOSE_WAIT)  # two passes never draw from one loader at once
        if self._stager is None:
            self._stager = (_CpuStager(self.transform) if self.device.type == "cpu"
                            else _CudaStager(self.device, self.transform))
        epoch = _Epoch(self.loader, self._stager, self.depth, self.timeout, self._counter)
        self._current = weakref.ref(epoch)
        return epoch

    def close(self) -> None:
        """End the current pass now (as leaving the loop does)."""
        current = self._current() if self._current is not None else None
        if current is not None:
            current.close()

    def statistics(self) -> waits.DataWait:
        """This prefetcher's steps so far: how long they waited for their batches."""
        return self._counter.snapshot()
