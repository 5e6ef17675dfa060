"""`ShmMessageQueue`: one writer, several readers, a ring of slots in POSIX shared memory.

Rank 0 of a tensor-parallel group sends every step's `StepMessage` to the other ranks of
its node through this queue instead of a gloo ``broadcast_object`` (a TCP round of two
messages per rank, 0.7-1.1 ms per step on H100 hosts). The design follows the idea of
vLLM's ``MessageQueue`` (vllm/distributed/device_communicators/shm_broadcast.py): a ring
buffer in shared memory that the writer fills and the readers poll.

Layout of the segment (little-endian int64 words, every region 64-byte aligned):

* header: magic, ``num_readers``, ``num_slots``, ``slot_bytes``;
* per slot, one 64-byte line written by the writer: ``seq`` (the number of the chunk in
  the slot, 1, 2, ...; 0 = never written), ``nbytes`` (payload bytes in the slot),
  ``more`` (1: the message continues in the next chunk);
* per reader, one region written by that reader alone: ``ack[slot]`` (the ``seq`` it
  last consumed from each slot) and ``attached`` (1 once it has mapped the segment);
* the slots' data, ``num_slots * slot_bytes``.

Chunk ``n`` goes to slot ``(n - 1) % num_slots``. The writer waits until every reader has
acknowledged the slot's previous chunk (a slow reader is never overwritten), copies the
payload in, then publishes by storing ``seq = n`` last. A reader waits for ``seq == n``,
copies the payload out, then stores ``ack = n``. x86-64 keeps stores in program order and
aligned 8-byte stores are atomic, so a reader that sees ``seq == n`` sees the payload.

A message is ``pickle`` protocol 5 with out-of-band buffers: numpy arrays (the step's host
tensors travel as numpy, see `StepMessage.__getstate__`) are copied as raw bytes next to
a small pickled header, never pickled. A frame larger than one slot is cut into chunks
over consecutive slots (the readers drain them while the writer fills them).

Waiting (both sides): poll with ``os.sched_yield`` for ``spin_s``, then sleep, doubling
from 10 us up to ``max_sleep_s`` (an idle server costs the readers almost no CPU).

The segment's name lives in /dev/shm only between `create` and `unlink`: the writer
unlinks it once every reader has attached (the mappings stay valid), so nothing is left
behind whichever process dies later. If the writer dies before that, the
``multiprocessing`` resource tracker of its process removes the segment.

Errors: `ShmQueueTimeout` (a wait passed ``timeout_s``), `ShmQueueAborted` (``abort_check``
returned a reason, e.g. a rank died), ValueError (bad sizes, or a handle of another
layout).
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import secrets
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any, Callable, List, Optional

_MAGIC = 0x4154534E51000001  # "ATSNQ" + layout version 1
_WORD = 8
_LINE = 64  # bytes; one cache line
_HEADER_BYTES = _LINE
_ALIGN = 16  # out-of-band buffers start at this alignment within a frame
#: a waiting side checks ``abort_check`` and its timeout this often (seconds)
_CHECK_INTERVAL_S = 0.1


class ShmQueueTimeout(TimeoutError):
    """A queue wait lasted longer than its ``timeout_s``."""


class ShmQueueAborted(RuntimeError):
    """``abort_check`` reported a reason to stop waiting (e.g. a rank died)."""


@dataclass(frozen=True)
class ShmQueueHandle:
    """What a reader needs to attach (picklable; rank 0 broadcasts it once).

    Attributes:
        name: the POSIX shared-memory name (a file under /dev/shm on Linux).
        num_readers / num_slots: ring geometry.
        slot_bytes: payload bytes per slot (a multiple of 64).
    """

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class _Layout:
    num_readers: int
    num_slots: int
    slot_bytes: int

    @property
    def reader_words(self) -> int:  # acks of every slot + the attached flag, whole lines
        return _round_up(self.num_slots + 1, _LINE // _WORD)

    @property
    def slot_meta_off(self) -> int:
        return _HEADER_BYTES

    @property
    def reader_off(self) -> int:
        return self.slot_meta_off + self.num_slots * _LINE

    @property
    def data_off(self) -> int:
        return self.reader_off + self.num_readers * self.reader_words * _WORD

    @property
    def total_bytes(self) -> int:
        return self.data_off + self.num_slots * self.slot_bytes


class ShmMessageQueue:
    """The writer's or one reader's end of a shared-memory broadcast ring.

    Build with `create` (the writer) or `attach` (a reader); not thread-safe (one writer
    thread, one thread per reader).

    Attributes:
        spin_s: seconds a wait polls with ``sched_yield`` before it starts sleeping.
        max_sleep_s: longest sleep between polls after that.
        timeout_s: a wait longer than this raises `ShmQueueTimeout` (None: no limit).
        abort_check: called every 0.1 s while waiting; a non-empty string it returns is
            raised as `ShmQueueAborted`.
    """

    def __init__(self, buf: memoryview, closer: Callable[[], None], layout: _Layout, name: str,
                 reader_rank: Optional[int], unlinker: Optional[Callable[[], None]] = None):
        self._buf = buf
        self._closer = closer
        self._unlinker = unlinker
        self.layout = layout
        self.name = name
        self.reader_rank = reader_rank
        self._words = buf[: layout.data_off].cast("q")
        self._data = buf[layout.data_off: layout.total_bytes]
        self._next = 1  # the next chunk's seq to write (writer) or to read (reader)
        self.spin_s = 0.005
        self.max_sleep_s = 0.001
        self.timeout_s: Optional[float] = None
        self.abort_check: Optional[Callable[[], Optional[str]]] = None
        if reader_rank is not None:
            self._words[self._reader_word(reader_rank, layout.num_slots)] = 1  # attached

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> "ShmMessageQueue":
        """The writer's end of a new segment (``num_slots * slot_bytes`` of payload), the
        file /dev/shm/attnserve-stepq-<pid>-<random>.

        Raises:
            ValueError: ``num_readers < 1``, ``num_slots < 2`` or ``slot_bytes < 64``.
            OSError: the segment cannot be created or its memory reserved (a full /dev/shm
                fails here, not later with SIGBUS).
        """
        if num_readers < 1 or num_slots < 2 or slot_bytes < _LINE:
            raise ValueError(f"need num_readers >= 1, num_slots >= 2, slot_bytes >= {_LINE}; got {num_readers}, "
                             f"{num_slots}, {slot_bytes}")
        layout = _Layout(num_readers, num_slots, _round_up(slot_bytes, _LINE))
        name = f"attnserve-stepq-{os.getpid()}-{secrets.token_hex(4)}"
        path = _segment_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # the resource tracker removes the name if this process dies before `unlink`
                # (as for multiprocessing.shared_memory, whose tracker names carry a "/")
                resource_tracker.register("/" + name, "shared_memory")
            except BaseException:
                os.unlink(path)
                raise
            try:
                _reserve(fd, layout.total_bytes)
                mm = mmap.mmap(fd, layout.total_bytes)
            except BaseException:
                _remove(name)
                raise
        finally:
            os.close(fd)
        buf = memoryview(mm)
        struct.pack_into("<4q", buf, 0, _MAGIC, num_readers, num_slots, layout.slot_bytes)
        return cls(buf, mm.close, layout, name, None, unlinker=lambda: _remove(name))

    @classmethod
    def attach(cls, handle: ShmQueueHandle, reader_rank: int) -> "ShmMessageQueue":
        """Reader ``reader_rank`` (in ``[0, num_readers)``) maps the writer's segment.

        The segment is opened as /dev/shm/<name> and mapped directly (not through
        ``multiprocessing.shared_memory``, whose resource tracker would, before Python
        3.13, adopt and later remove a segment this process does not own).

        Raises:
            FileNotFoundError: no such segment (another host, or already unlinked).
            ValueError: ``reader_rank`` out of range, or the segment's header does not match
                ``handle``.
        """
        if not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.num_readers})")
        layout = _Layout(handle.num_readers, handle.num_slots, handle.slot_bytes)
        fd = os.open(_segment_path(handle.name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        buf = memoryview(mm)
        header = struct.unpack_from("<4q", buf, 0)
        if header != (_MAGIC, handle.num_readers, handle.num_slots, handle.slot_bytes):
            buf.release()
            mm.close()
            raise ValueError(f"shared-memory segment {handle.name!r} has header {header}, expected {handle}")
        return cls(buf, mm.close, layout, handle.name, reader_rank)

    @property
    def handle(self) -> ShmQueueHandle:
        lay = self.layout
        return ShmQueueHandle(self.name, lay.num_readers, lay.num_slots, lay.slot_bytes)

    @property
    def is_writer(self) -> bool:
        return self.reader_rank is None

    def attached(self) -> List[bool]:
        """Which readers have mapped the segment."""
        n = self.layout.num_slots
        return [bool(self._words[self._reader_word(r, n)]) for r in range(self.layout.num_readers)]

    def unlink(self) -> None:
        """Remove the segment's name (writer; idempotent). Mappings stay valid: call it
        once every reader has attached."""
        if self._unlinker is not None:
            unlinker, self._unlinker = self._unlinker, None
            try:
                unlinker()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap (and, on the writer, unlink if not done); idempotent."""
        self.unlink()
        if self._closer is None:
            return
        closer, self._closer = self._closer, None
        for view in (self._words, self._data, self._buf):
            view.release()
        try:
            closer()
        except BufferError:  # a view still exported elsewhere: the mapping goes with the process
            pass

    # ---------------------------------------------------------------- indices

    def _slot_word(self, slot: int) -> int:  # seq; +1 nbytes; +2 more
        return (self.layout.slot_meta_off + slot * _LINE) // _WORD

    def _reader_word(self, reader: int, index: int) -> int:
        return self.layout.reader_off // _WORD + reader * self.layout.reader_words + index

    # ---------------------------------------------------------------- waiting

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        start = time.perf_counter()
        next_check = start + _CHECK_INTERVAL_S
        sleep = 1e-5
        while not ready():
            now = time.perf_counter()
            if now >= next_check:
                next_check = now + _CHECK_INTERVAL_S
                if self.abort_check is not None:
                    reason = self.abort_check()
                    if reason:
                        raise ShmQueueAborted(f"stopped waiting for {what}: {reason}")
                if self.timeout_s is not None and now - start > self.timeout_s:
                    raise ShmQueueTimeout(f"waited {now - start:.1f} s for {what} on shared-memory queue "
                                          f"{self.name!r}")
            if now - start < self.spin_s:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(2 * sleep, self.max_sleep_s)

    # ---------------------------------------------------------------- writer

    def _acquire_slot(self) -> tuple:
        """Wait until every reader has consumed the slot of chunk ``self._next``."""
        lay = self.layout
        slot = (self._next - 1) % lay.num_slots
        w = self._words
        sw = self._slot_word(slot)
        old = w[sw]
        acks = [self._reader_word(r, slot) for r in range(lay.num_readers)]
        if any(w[a] != old for a in acks):
            def free():
                return all(w[a] == old for a in acks)

            slow = [r for r, a in enumerate(acks) if w[a] != old]
            self._wait(free, f"reader(s) {slow} to consume chunk {old}")
        return slot, sw

    def _publish(self, sw: int, nbytes: int, more: bool) -> None:
        w = self._words
        w[sw + 1] = nbytes
        w[sw + 2] = int(more)
        w[sw] = self._next  # last: the readers' signal
        self._next += 1

    def enqueue(self, obj: Any) -> int:
        """Send ``obj`` to every reader (writer only). Blocks only while the ring is full.

        Returns:
            the frame's size in bytes.
        """
        if not self.is_writer:
            raise RuntimeError("enqueue is the writer's; this end is reader "
                               f"{self.reader_rank}")
        oob: List[pickle.PickleBuffer] = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=oob.append)
        parts = [memoryview(head)] + [b.raw() for b in oob]
        offsets, size = _frame_layout([p.nbytes for p in parts])
        slot_bytes = self.layout.slot_bytes
        if size <= slot_bytes:  # the common case: written straight into the slot
            slot, sw = self._acquire_slot()
            base = slot * slot_bytes
            _write_frame(self._data, base, parts, offsets)
            self._publish(sw, size, False)
            return size
        frame = memoryview(bytearray(size))
        _write_frame(frame, 0, parts, offsets)
        for start in range(0, size, slot_bytes):
            n = min(slot_bytes, size - start)
            slot, sw = self._acquire_slot()
            self._data[slot * slot_bytes: slot * slot_bytes + n] = frame[start: start + n]
            self._publish(sw, n, start + n < size)
        return size

    # ---------------------------------------------------------------- reader

    def dequeue(self) -> Any:
        """The next message (reader only); waits for it."""
        if self.is_writer:
            raise RuntimeError("dequeue is a reader's; this end is the writer")
        lay = self.layout
        w = self._words
        frame = None
        while True:
            seq = self._next
            slot = (seq - 1) % lay.num_slots
            sw = self._slot_word(slot)
            if w[sw] != seq:
                self._wait(lambda: w[sw] == seq, f"message chunk {seq} from the writer")
            nbytes, more = w[sw + 1], w[sw + 2]
            base = slot * lay.slot_bytes
            chunk = self._data[base: base + nbytes]
            if frame is None:
                frame = bytearray(chunk)  # the one copy out of the ring
            else:
                frame += chunk
            chunk.release()
            w[self._reader_word(self.reader_rank, slot)] = seq  # the slot is free for the writer
            self._next = seq + 1
            if not more:
                return _read_frame(frame)


def _frame_layout(lengths: List[int]) -> tuple:
    """Byte offsets of each part of a frame and the frame's size.

    A frame: int64 part count, int64 length of each part, then the parts, each starting
    at a multiple of 16 bytes (part 0: the pickle stream; then the out-of-band buffers).
    """
    off = _round_up(_WORD * (1 + len(lengths)), _ALIGN)
    offsets = []
    for n in lengths:
        offsets.append(off)
        off = _round_up(off + n, _ALIGN)
    return offsets, off


def _write_frame(dst: memoryview, base: int, parts: List[memoryview], offsets: List[int]) -> None:
    struct.pack_into(f"<{1 + len(parts)}q", dst, base, len(parts), *(p.nbytes for p in parts))
    for p, off in zip(parts, offsets):
        dst[base + off: base + off + p.nbytes] = p


def _read_frame(frame: bytearray) -> Any:
    view = memoryview(frame)
    (count,) = struct.unpack_from("<q", view, 0)
    lengths = struct.unpack_from(f"<{count}q", view, _WORD)
    offsets, _ = _frame_layout(list(lengths))
    parts = [view[off: off + n] for off, n in zip(offsets, lengths)]
    # the out-of-band buffers become numpy arrays viewing ``frame`` (private, writable)
    return pickle.loads(parts[0], buffers=parts[1:])


def _segment_path(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


def _reserve(fd: int, size: int) -> None:
    """Size the segment, reserving its memory where the file system can (a full /dev/shm
    then fails here with ENOSPC rather than later with SIGBUS on a write)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _remove(name: str) -> None:
    """Unlink the segment and drop it from the resource tracker."""
    try:
        os.unlink(_segment_path(name))
    finally:
        resource_tracker.unregister("/" + name, "shared_memory")


def shm_available() -> bool:
    """Whether POSIX shared memory is mapped through /dev/shm here (Linux)."""
    return sys.platform.startswith("linux") and os.path.isdir("/dev/shm")
