"""What unfinished saves leave behind: finding it, and removing it safely.

`pz_persist.save` writes a checkpoint under a hidden sibling name,
``.NAME.pz_persist-new-TOKEN`` (Orbax first writes it as
``.NAME.pz_persist-new-TOKEN.orbax-checkpoint-tmp``), and renames it into
place when it is complete. Everything one save writes there starts with that
name, its *family*; next to it the save keeps a small marker file,
``.NAME.pz_persist-new-TOKEN.writer``, saying who writes it (host name, boot
id, pid and the process's start time) and locked (``flock``) by the writer
for as long as it writes.

A save that is interrupted (Ctrl-C, or any exception) removes its family
itself (see `writing`). A save that dies (SIGKILL, power loss) cannot; a later
save of the same path removes it, and ``pz-persist clean PATH`` removes those
of a checkpoint path or of a whole directory. A family is removed only when
its writer is provably gone (`Leftover.status` is ``"dead"``):

* its marker's lock can be taken (the kernel drops a lock when its process
  dies, whatever pid it had), and
* the marker was written on this host, and either this machine restarted
  since (another boot id), or no process has that pid any more, or the one
  that has it started at another time (the pid was reused), or it is this
  very process and that save is no longer running (it was interrupted).

Families with no readable marker (written by older versions), written on
another host or in another pid namespace are never removed automatically:
nothing proves their writer is gone. ``pz-persist clean --force`` removes
them, and Orbax's temporary steps in a ``CheckpointManager`` directory, on
the user's word that nothing writes there any more; a family whose writer is
provably alive is never removed, nor a temporary step while a
``CheckpointManager`` has its run open (it holds `RUN_LOCK` from its opening
to its close: Orbax names the step it is writing like one a killed run left).

A marker is in a directory anyone may write, so it is read like every other
small file: opened without following a link or waiting on a FIFO, checked to
be a regular file, at most `_MAX_MARKER_BYTES` of bounded JSON. Anything else
(a FIFO, a directory, 4,000 nested ``[``) proves nothing: its family's writer
is ``"unknown"``, never a hang or an exception.

On an object store (``gs://``, ``s3://``) a save writes a generation folder
beside the commit objects and publishes it by creating a commit object
(`pz_persist.storage.stores.commit_objects`); a killed or losing save leaves its
generation folder, which no commit names (an *orphan*), and a killed
``CheckpointManager`` step leaves a step without its commit marker. There
are no locks or pids there to prove a writer gone (a save still running
looks exactly like a dead one), so these are reported with status
``"unknown"`` or ``"orbax tmp step"`` and removed only with ``force``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Iterator

from etils import epath

from pz_persist import errors
from pz_persist.safety import bounded_json
from pz_persist.safety import safe_io
from pz_persist.safety import terminal
from pz_persist.storage import orbax_seam
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import steps

try:
  import fcntl
except ImportError:  # Windows: no locks; markers alone decide.
  fcntl = None  # type: ignore[assignment]  # Optional module: callers test for None.

MARKER_SUFFIX = ".writer"
"""Added to a family's name for its marker file."""

_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TRASH_SUFFIX = ".pz_persist-deleting"
_FAMILY = re.compile(
    r"^\.(?P<name>.+)\.pz_persist-(?P<role>new|old)-(?P<token>[0-9a-f]+)"
)

_writing: set[str] = set()
"""Families this process is writing now (their full paths)."""
_writing_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Leftover:
  """What one unfinished save left.

  Attributes:
    name: The family's name, e.g. ``/runs/.ckpt.pz_persist-new-1f2e...``.
    entries: Its files and directories.
    nbytes: Bytes in them.
    status: ``"dead"`` (its writer is gone: safe to remove), ``"live"`` (a
      process is writing it, or a ``CheckpointManager`` has its run open),
      ``"unknown"`` (nothing proves either: no marker, an unreadable one,
      another host, another container) or ``"orbax tmp step"`` (a
      ``CheckpointManager`` step Orbax had not finished, no manager open).
    reason: How the status was decided, for people.
    store: The store it is on (asked how it may be removed).
  """

  name: epath.Path
  entries: tuple[epath.Path, ...]
  nbytes: int
  status: str
  reason: str
  store: stores.Store = dataclasses.field(compare=False, repr=False)

  @property
  def removable(self) -> bool:
    return self.status == "dead"


# ---- Writing: the marker of a save in progress, and abandoning it. ----------


@dataclasses.dataclass
class Writing:
  """What `writing` yields; after an abandoned save, what of it stays.

  Attributes:
    target: The family being written.
    left: Filled when the save was abandoned: the entries that stay beside
      the checkpoint (an empty placeholder and the marker, when a write of
      the save might still land: see `_abandon`); empty when everything it
      wrote was removed.
  """

  target: epath.Path
  left: tuple[epath.Path, ...] = ()


@contextlib.contextmanager
def writing(
    store: stores.Store, target: epath.Path, *, cancel: Callable[[], object],
    primary: bool = True,
) -> Iterator[Writing]:
  """Marks ``target`` (on ``store``) as being written by this process while the block runs.

  The marker is created and locked before anything of ``target`` exists, so
  no cleaner ever mistakes the family of a running save for a dead one; it
  is made whole with Ctrl-C held back, so an interrupt never leaves a marker
  that nothing removes. If the block raises (an error, or Ctrl-C), the save
  is abandoned before the exception goes on: ``cancel`` stops Orbax's
  background work and returns True if every write the save started has
  ended (`pz_persist.orbax.v0_handler.PenzaiCheckpointHandler.cancel`), and
  `_abandon` deletes the family, marker included, or, if a write might still
  land, leaves an empty placeholder and the marker (recorded in the yielded
  `Writing`'s ``left``). Otherwise the marker is removed (the family itself
  was moved into place or deleted by then). Only the primary process marks
  and deletes: the others write into the directory it created.
  """
  started_after = set(threading.enumerate())
  local = primary and store.has_locks  # Else no marker to hold.
  marker, fd = _marker(target), None
  state = Writing(target)
  with _writing_lock:
    _writing.add(os.fspath(target))
  try:
    try:
      if local:
        with interrupts_deferred():  # The marker exists only whole, with fd set.
          fd = os.open(
              os.fspath(marker), os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644
          )
          if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # A new file: nobody else holds it.
          os.write(fd, json.dumps(_this_writer()).encode())
      yield state
    except BaseException:
      with interrupts_deferred():  # A second Ctrl-C must not stop the cleanup.
        settled = cancel_background(cancel, started_after)
        if fd is not None:
          state.left = _abandon(target, fd, settled=settled)
        elif primary and not local:  # Remote: no placeholder can be put.
          remove_unfinished(target)
      raise
    if fd is not None:
      _unlink(marker)
  finally:
    with _writing_lock:
      _writing.discard(os.fspath(target))
    if fd is not None:
      os.close(fd)  # Releases the lock.


def remove_unfinished(target: epath.Path) -> None:
  """Deletes what a failed save to the unique ``target`` left, and only that.

  Raises:
    UnsafeCheckpointError: one of these names (all the save's own
      directories) is a symlink or not a directory; it is left untouched.
  """
  for leftover in target.parent.glob(f"{target.name}.orbax-checkpoint-tmp*"):
    safe_io.remove_tree(leftover, strict=True)
  safe_io.remove_tree(target, strict=True)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
  """Holds Ctrl-C back (in the main thread) until the block is done.

  For short steps that must not stop halfway: moving a checkpoint into place
  (a few renames; interrupted between two of them, where no atomic exchange
  exists, the path would be left empty) and cleaning up after an interrupted
  save (bounded: a few seconds at most).
  """
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
    yield
    return
  received = []
  signal.signal(signal.SIGINT, lambda *_: received.append(True))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  if received:
    raise KeyboardInterrupt


def cancel_background(
    cancel: Callable[[], object], started_after: set[threading.Thread]
) -> bool:
  """Stops Orbax's background work of an unfinished save; returns whether
  every write it started has ended: ``cancel`` said so, and Orbax's threads
  of the save (which also create directories and write metadata files) have
  all ended. For `writing`, and for an interrupted `CheckpointManager` save
  (`pz_persist.training.interrupted`).

  Its threads (those started since ``started_after``) stop within
  milliseconds once cancelled; waiting for them keeps them from logging
  tracebacks about the files deleted under them, and the interpreter's exit
  from waiting for them. File operations Orbax queued on its event loop's
  pool before the interrupt are waited for too (`_finishing_pool_workers`):
  they would otherwise make again what the cleanup deletes.
  """
  try:
    settled = bool(cancel())
  except Exception:  # pylint: disable=broad-exception-caught
    settled = False
  return _join_save_threads(started_after, timeout=_JOIN_SECONDS) and settled


def _abandon(target: epath.Path, marker_fd: int, *, settled: bool) -> tuple[epath.Path, ...]:
  """Deletes what an unfinished save to ``target`` wrote; returns what stays.

  When every write of the save has ended (``settled``), nothing can land
  any more: the whole family is deleted, marker included, before the save's
  exception goes on (deleting is quick once no write holds a file), and
  nothing stays.

  Otherwise (writes Orbax's own handler issued, which cannot be followed
  from here, or a direct write that did not end in time) TensorStore's
  writes under way go on after the save's error or interrupt and would
  create again the directories deleted under them (a plain delete left GBs
  behind). So Orbax's temporary directory is renamed away and an empty file
  put in its place, where every late write fails at once; then what was
  renamed is deleted (see `_delete_soon`). The empty placeholder stays, with
  the marker, now saying "abandoned" and unlocked, for `remove_dead` (the
  next save of the path, or ``pz-persist clean``); they are returned.
  """
  marker = _marker(target)
  if settled:
    left = []
    for entry in _family_entries(target):
      if os.fspath(entry) != os.fspath(marker):
        try:
          delete(entry)
        except OSError:
          left.append(entry)
    if not left:
      _unlink(marker)
      return ()
    return (*left, marker)
  trashes = []
  for entry in _family_entries(target):
    if os.fspath(entry) == os.fspath(marker):
      continue
    if entry.name.endswith(_TRASH_SUFFIX):
      trashes.append(entry)
      continue
    trash = entry.parent / (entry.name + _TRASH_SUFFIX)
    try:
      os.rename(os.fspath(entry), os.fspath(trash))
    except OSError:
      trashes.append(entry)
      continue
    trashes.append(trash)
    if entry.name.startswith(target.name + _TMP_SUFFIX):
      with contextlib.suppress(OSError):
        os.close(os.open(os.fspath(entry), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644))
  placeholders = tuple(
      e for e in _family_entries(target) if e.name.startswith(target.name + _TMP_SUFFIX)
  )
  if not placeholders:
    trashes.append(marker)  # No placeholder: nothing left to guard.
  else:
    with contextlib.suppress(OSError):
      os.ftruncate(marker_fd, 0)
      os.pwrite(marker_fd, json.dumps(dict(_this_writer(), abandoned=True)).encode(), 0)
  _delete_soon(trashes)
  return (*placeholders, marker) if placeholders else ()


def _delete_soon(entries: list[epath.Path]) -> None:
  """Deletes ``entries``, waiting at most `_DELETE_WAIT_SECONDS` for it.

  Why not wait: deleting a file TensorStore is still writing waits for that
  write (the kernel locks the file), which may take as long as the rest of
  the save would have. The deletion goes on in the background (a notebook
  gets its prompt back at once); a script exiting meanwhile finishes it
  first (its exit waits for TensorStore's writes anyway). What is left if
  the process is killed is still named after the save, and its marker says
  "abandoned": the next save of the path, or ``pz-persist clean``, deletes it.
  """
  def delete_all():
    for entry in entries:
      delete(entry)

  worker = threading.Thread(target=delete_all, name="pz_persist_delete", daemon=True)
  worker.start()
  worker.join(_DELETE_WAIT_SECONDS)
  if worker.is_alive():
    atexit.register(worker.join, _DELETE_AT_EXIT_SECONDS)


_DELETE_WAIT_SECONDS = 1.0
_DELETE_AT_EXIT_SECONDS = 60.0


def _unlink(name: epath.Path) -> None:
  with contextlib.suppress(OSError):
    os.unlink(os.fspath(name))


_JOIN_SECONDS = 10.0
"""The longest an abandoned save waits for Orbax's cancelled threads. They stop
within milliseconds once cancelled, and the wait ends when they do; the bound
only matters on a starved machine, where 3 s proved too short (CI's version
step, two CPU-bound processes beside it: the threads outlived it, so a
placeholder was left for the next save to clean instead of nothing).
TensorStore's own writes are not waited for."""


def _join_save_threads(started_after: set[threading.Thread], timeout: float) -> bool:
  """Waits (at most ``timeout`` s in all) for Orbax's save threads started
  since, and for the workers of thread pools shut down since
  (`_finishing_pool_workers`); returns whether they all ended (False if
  Orbax's cannot be told)."""
  try:
    kind = orbax_seam.orbax_save_threads()
  except AttributeError:
    return False  # Another Orbax: the placeholder file still stops late writes.
  deadline = time.monotonic() + timeout
  ended = True
  waited = [
      thread for thread in threading.enumerate()
      if isinstance(thread, kind) and thread not in started_after
  ]
  for thread in waited + _finishing_pool_workers(started_after, besides=waited):
    ended = _join_until(thread, deadline) and ended
  return ended


def _join_until(thread: threading.Thread, deadline: float) -> bool:
  """Waits until ``thread`` ends or ``deadline`` (``time.monotonic``)
  passes; whether it ended.

  ``threading.Thread.join`` itself: Orbax's own join raises once cancelled,
  still running. A thread whose ``start`` the Ctrl-C interrupted is listed
  by ``threading.enumerate`` but refused by ``join`` ("cannot join thread
  before it is started"; that error replaced the interrupt, so a script
  ended with status 1 and a traceback, about one SIGINT test in 20): it may
  still start and do its work, so it is waited for to start too, and one
  that has not started by the deadline counts as still running.
  """
  while True:
    try:
      threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
      return not thread.is_alive()
    except RuntimeError:  # Not started (yet).
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.001)


def _finishing_pool_workers(
    started_after: set[threading.Thread], besides: list[threading.Thread]
) -> list[threading.Thread]:
  """Threads started since ``started_after`` that work for a thread pool
  already shut down: they run what was queued before the shutdown, then end.

  Why: Orbax makes a save's temporary directory (and does its other file
  operations) through ``asyncio.to_thread``, on its event loop's default
  pool. A Ctrl-C in that loop leaves the ``mkdir`` queued there; the loop's
  ``close`` shuts the pool down, and the ``mkdir`` runs anyway, after the
  save deleted what it wrote: one run in 40 left an empty
  ``.orbax-checkpoint-tmp`` beside a checkpoint whose save said it "removed
  everything it had written" (``tests/test_interrupt.py``). Pools still
  open (a program's own) are not waited for: their threads may never end.
  Read through `concurrent.futures`' private worker arguments; elsewhere,
  nothing is waited for here and the save cleans up as before.
  """
  worker = getattr(concurrent.futures.thread, "_worker", None)
  if worker is None:
    return []
  found = []
  for thread in threading.enumerate():
    if thread in started_after or thread in besides:
      continue
    if getattr(thread, "_target", None) is not worker:
      continue
    arguments = getattr(thread, "_args", ())
    pool = arguments[0]() if arguments and isinstance(arguments[0], weakref.ref) else None
    if pool is None or getattr(pool, "_shutdown", False):
      found.append(thread)
  return found


# ---- Finding leftovers. -----------------------------------------------------


def find(store: stores.Store, path: epath.Path) -> list[Leftover]:
  """Leftovers of saves to the checkpoint path ``path`` on ``store`` (as
  `stores.choose` spells it): beside it; on an object store, its generation
  folders no commit names."""
  if not store.has_locks:
    return _orphans(store, path)
  return _families(path.parent, of=path.name)


def find_inside(store: stores.Store, directory: epath.Path) -> list[Leftover]:
  """Leftovers of saves to any path directly inside ``directory`` on
  ``store``, and Orbax's unfinished ``CheckpointManager`` steps there."""
  if not store.has_locks:
    return _remote_inside(store, directory)
  if not os.path.isdir(os.fspath(directory)):
    return []
  found = _families(directory)
  uncommitted = [
      entry for entry in sorted(os.scandir(os.fspath(directory)), key=lambda e: e.name)
      if (parsed := steps.parse_step_name(entry.name)) is not None and not parsed[1]
  ]
  if not uncommitted:
    return found
  with run_unused(directory) as unused:
    status, reason = ("orbax tmp step", _TMP_STEP_REASON) if unused is True else (
        ("live", _RUN_IN_USE) if unused is False else ("unknown", unused))
  found += [
      Leftover(name=directory / entry.name, entries=(directory / entry.name,),
               nbytes=steps.disk_bytes(entry.path), status=status, reason=reason, store=store)
      for entry in uncommitted
  ]
  return found


_TMP_STEP_REASON = "Orbax removes it when a CheckpointManager opens this directory"
_RUN_IN_USE = (
    "a CheckpointManager has this run open (it holds the run's lock): a step"
    " it is writing"
)


# ---- The run lock: a CheckpointManager writing a run directory. -------------

RUN_LOCK = ".pz_persist-run.lock"
"""The file in a run directory that each open `CheckpointManager` holds a
shared ``flock`` on, from its opening to its ``close``: the lock of a writer
of that run's steps (Orbax names a step being written like one a killed run
left, ``5.orbax-checkpoint-tmp-...``). ``pz-persist clean`` takes it
exclusively before removing any uncommitted step, and keeps them all while
a manager holds it."""

_RUN_LOCK_WAIT_SECONDS = 60.0


def _open_run_lock(directory: epath.Path, *, create: bool) -> int | None:
  """A descriptor of ``directory``'s `RUN_LOCK`, or None if it does not exist.

  Opened like every small file pz_persist touches in a directory others may
  write: never following a link, never blocking on a FIFO, and refused
  unless it is a regular file.

  Raises:
    UnsafeCheckpointError: it is a link, a directory, a FIFO or a device.
  """
  name = os.fspath(directory / RUN_LOCK)
  flags = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | (os.O_CREAT if create else 0)
  try:
    fd = os.open(name, flags, 0o644)
  except FileNotFoundError:
    if create:
      raise
    return None
  except OSError as e:
    kind = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}.get(e.errno or 0)
    if kind is not None:
      raise errors.UnsafeCheckpointError(
          f"{name} is {kind}, not a regular file; pz_persist never writes one"
          " there. Remove it (it is the lock CheckpointManagers of this run hold)."
      ) from None
    raise
  info = os.fstat(fd)
  if not stat.S_ISREG(info.st_mode):
    os.close(fd)
    raise errors.UnsafeCheckpointError(
        f"{name} is {safe_io.special_kind(info.st_mode)}, not a regular file;"
        " it is the lock CheckpointManagers of this run hold. Remove it."
    )
  return fd


def hold_run(store: stores.Store, directory: epath.Path) -> int | None:
  """Takes a shared hold on the run ``directory`` (on ``store``) for an open manager.

  Returns the descriptor to pass to `release_run` (None where there are no
  locks: object stores, Windows). Waits (at most `_RUN_LOCK_WAIT_SECONDS`)
  while ``pz-persist clean`` removes the run's uncommitted steps.

  Raises:
    UnsafeCheckpointError: the lock file is not a regular file.
    ConcurrentSaveError: a cleaner held the run for the whole wait.
  """
  if fcntl is None or not store.has_locks:
    return None
  try:
    fd = _open_run_lock(directory, create=True)
  except OSError as e:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      return None  # A run this process cannot write (restoring only): no writer.
    raise
  assert fd is not None
  deadline = time.monotonic() + _RUN_LOCK_WAIT_SECONDS
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
      return fd
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return fd  # Locks unsupported here: nothing to hold.
      if time.monotonic() > deadline:
        os.close(fd)
        raise errors.ConcurrentSaveError(
            f"{directory}: another process has held the run's lock"
            f" ({RUN_LOCK}) exclusively for {_RUN_LOCK_WAIT_SECONDS:.0f} s"
            " (pz-persist clean removing its unfinished steps?); try again."
        ) from None
      time.sleep(0.05)


def release_run(fd: int | None) -> None:
  """Gives back what `hold_run` took."""
  if fd is not None:
    os.close(fd)


@contextlib.contextmanager
def run_unused(directory: epath.Path) -> Iterator[bool | str]:
  """Holds ``directory``'s run lock exclusively if no manager holds it.

  Yields True (no manager has the run open; none can open it until the
  block ends), False (one does) or, if the lock file is not a regular file,
  a string saying so (nothing proves the run unused).
  """
  try:  # No locks (Windows): nothing to hold or find held.
    fd = _open_run_lock(directory, create=False) if fcntl is not None else None
  except errors.UnsafeCheckpointError as e:
    yield f"{e}"
    return
  except OSError as e:
    yield f"its run's lock {RUN_LOCK} cannot be opened ({e.strerror})"
    return
  if fd is None:
    yield True
    return
  try:
    yield not _held_by_another(fd)
  finally:
    os.close(fd)


def _held_by_another(fd: int) -> bool:
  """Takes an exclusive lock on ``fd`` unless another holds one; True if
  another does. Where files cannot be locked (some network filesystems),
  False: the lock proves nothing there, and the caller's markers decide."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
  return False


def find_all(path: epath.PathLike) -> list[Leftover]:
  """Leftovers beside ``path`` and, if it is a directory, inside it."""
  store, path = stores.choose(path)
  return find(store, path) + find_inside(store, path)


_ORPHAN_REASON = (
    "no commit names it: a killed or losing save, or one still running (an"
    " object store cannot tell them apart)"
)
_REMOTE_STEP_REASON = (
    "no commit marker: a step a killed run or retention left, or one still"
    " being written; Orbax removes it when a CheckpointManager opens this run"
)


def _orphans(store: stores.Store, path: epath.Path) -> list[Leftover]:
  """The generation folders of the remote checkpoint ``path`` that no commit
  names (`stores.base.Store.orphans`), each with its size (one listing each)."""
  return [
      Leftover(name=orphan, entries=(orphan,),
               nbytes=sum(info.size for info in store.tree(orphan).values()),
               status="unknown", reason=_ORPHAN_REASON, store=store)
      for orphan in store.orphans(path)
  ]


def _remote_inside(store: stores.Store, directory: epath.Path) -> list[Leftover]:
  """`find_inside` on an object store: the orphans of each checkpoint
  directly inside ``directory``, and its uncommitted steps."""
  found = []
  for name in store.names(directory):
    if steps.parse_step_name(name) is None:
      found += _orphans(store, directory / name)
  found += [
      Leftover(name=step.path, entries=(step.path,), nbytes=step.nbytes,
               status="orbax tmp step", reason=_REMOTE_STEP_REASON, store=store)
      for step in steps.list_steps(directory, commit_times=False) if not step.committed
  ]
  return found


def _families(directory: epath.Path, of: str | None = None) -> list[Leftover]:
  """The leftover families in ``directory`` (of saves to ``of``, if given)."""
  try:
    names = sorted(os.listdir(os.fspath(directory)))
  except OSError:
    return []
  groups: dict[str, list[str]] = {}
  for name in names:
    match = _FAMILY.match(name)
    if match and of in (None, match["name"]):
      groups.setdefault(match.group(0), []).append(name)
  found = []
  for family, members in groups.items():
    base = directory / family
    status, reason = _status(base, directory)
    entries = tuple(directory / m for m in members)
    found.append(Leftover(
        name=base, entries=entries,
        nbytes=sum(steps.disk_bytes(e) for e in entries),
        status=status, reason=reason, store=stores.LOCAL,
    ))
  return found


def _status(family: epath.Path, directory: epath.Path) -> tuple[str, str]:
  """Whether the writer of ``family`` is provably gone, and why."""
  match = _family_parts(family)
  if match["role"] == "old":
    # A replaced checkpoint moved aside (no atomic exchange here). Only
    # garbage once the new one is in place; otherwise it may be the only copy.
    if os.path.lexists(os.fspath(directory / match["name"])):
      return "dead", "a replaced checkpoint, its replacement is in place"
    return "unknown", f"the previous checkpoint of {match['name']}, which is missing"
  with _marker_locked(family) as (locked, writer):
    if not locked:
      return "live", "its writer holds the lock on its marker"
  return _writer_status(family, writer)


def _writer_status(family: epath.Path, writer: dict | str | None) -> tuple[str, str]:
  """Decides from the marker's contents alone (its lock was free).

  ``writer`` is the parsed marker, or why it could not be read (a string).
  """
  if isinstance(writer, str):
    return "unknown", writer
  if not isinstance(writer, dict):
    return "unknown", "no readable writer marker (written by an older pz_persist?)"
  here = _this_writer()
  pid = writer.get("pid")
  who = f"pid {str(pid)[:40]} on {str(writer.get('host'))[:80]}"
  if writer.get("host") != here["host"]:
    return "unknown", f"written by {who}, another host"
  if writer.get("boot") and here["boot"] and writer["boot"] != here["boot"]:
    return "dead", f"written by {who} before this machine restarted"
  if writer.get("pidns") != here["pidns"]:
    return "unknown", f"written by {who} in another container (pid namespace)"
  if type(pid) is not int or not 0 < pid < _MAX_PID:  # os.kill overflows beyond.
    return "unknown", "no valid pid in its writer marker"
  if writer.get("abandoned"):
    return "dead", f"an interrupted save of {who}"
  if pid == here["pid"] and writer.get("start") == here["start"]:
    with _writing_lock:
      if os.fspath(family) in _writing:
        return "live", "this process is writing it"
    return "dead", "an interrupted save of this process"
  if not _pid_exists(pid):
    return "dead", f"{who} has exited"
  start = _start_time(pid)
  if start is not None and writer.get("start") is not None and start != writer["start"]:
    return "dead", f"{who} has exited (the pid now belongs to another process)"
  return "live", f"{who} is still running"


@contextlib.contextmanager
def _marker_locked(family: epath.Path):
  """Yields (lock taken, marker contents) holding the marker's lock if free.

  Holding it while the family is deleted keeps two cleaners apart. No marker
  (or one that cannot be opened) counts as free, with no contents; one that
  is not a small regular file of bounded JSON counts as free, with a string
  saying what it is instead (see `_read_marker`): a marker is in a directory
  anyone may write, and reading it must neither block nor fail.
  """
  try:
    fd = os.open(os.fspath(_marker(family)), os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
  except OSError as e:
    yield True, ("its writer marker is a symbolic link, which pz_persist never writes"
                 if e.errno == errno.ELOOP else None)
    return
  try:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      yield True, (f"its writer marker is {safe_io.special_kind(info.st_mode)},"
                   " not a regular file")
      return
    if fcntl is not None and _held_by_another(fd):
      yield False, None
      return
    yield True, _read_marker(fd, info.st_size)
  finally:
    os.close(fd)


def _read_marker(fd: int, size: int) -> dict | str | None:
  """The marker's JSON object, or why it is not one (a string), or None.

  Read like every other small file pz_persist reads: at most
  `_MAX_MARKER_BYTES`, parsed within `bounded_json`'s limits (a marker of
  4,000 nested ``[`` raised RecursionError from ``json.loads``).
  """
  if size > _MAX_MARKER_BYTES:
    return f"its writer marker is {size} bytes, over the {_MAX_MARKER_BYTES}-byte limit"
  try:
    data = os.read(fd, _MAX_MARKER_BYTES + 1)
  except OSError as e:
    return f"its writer marker cannot be read ({e.strerror})"
  if len(data) > _MAX_MARKER_BYTES:
    return f"its writer marker is over the {_MAX_MARKER_BYTES}-byte limit"
  try:
    return bounded_json.loads(data, where="marker", max_nodes=64, max_depth=4)
  except errors.ManifestError:
    return None


_MAX_MARKER_BYTES = 4096
_MAX_PID = 2**31


# ---- Removing. --------------------------------------------------------------


def remove_dead(store: stores.Store, path: epath.Path) -> list[Leftover]:
  """Removes the leftovers of saves to ``path`` on ``store`` whose writers are gone."""
  removed = []
  for leftover in find(store, path):
    if leftover.removable and remove(leftover):
      removed.append(leftover)
  return removed


def would_remove(leftover: Leftover, *, force: bool = False) -> bool:
  """Whether `remove` would remove ``leftover`` as it was found (``--dry-run``).

  An uncommitted step is never removed while its run's lock cannot be
  checked (``"unknown"``): a manager may have opened the run before its lock
  file was replaced.
  """
  if leftover.removable:
    return True
  if not force or leftover.status == "live":
    return False
  parsed = steps.parse_step_name(leftover.name.name)
  uncommitted_step = parsed is not None and not parsed[1]
  return not (
      uncommitted_step and leftover.status == "unknown"
      and leftover.store.has_locks
  )


def remove(leftover: Leftover, *, force: bool = False) -> bool:
  """Removes one leftover if it may be; True if it was.

  Dead ones always may be; with ``force`` also those whose writer is
  unknown (the user vouches that nothing writes them) and Orbax's temporary
  steps; live ones never. The status is decided again, under the marker's
  lock, just before deleting.
  """
  if not leftover.store.has_locks:
    if not force:  # Nothing proves a writer gone there (see above).
      return False
    for entry in leftover.entries:
      steps.remove_step(leftover.store, entry)  # Its commit marker first, if it has one.
    return True
  parsed = steps.parse_step_name(leftover.name.name)
  if parsed is not None and not parsed[1]:  # An uncommitted step (`find_inside`).
    if not force:
      return False
    with run_unused(leftover.name.parent) as unused:
      if unused is not True:  # A manager writes this run (or cannot be ruled out).
        return False
      delete(leftover.name)
    return True
  role = _family_parts(leftover.name)["role"]  # Before touching anything.
  with _marker_locked(leftover.name) as (locked, writer):
    if not locked:
      return False
    if role == "old":
      status, _ = _status(leftover.name, leftover.name.parent)
    else:
      status, _ = _writer_status(leftover.name, writer)
    if status == "live" or (status != "dead" and not force):
      return False
    for entry in leftover.entries:
      if os.fspath(entry) != os.fspath(_marker(leftover.name)):
        delete(entry)
    delete(_marker(leftover.name))
  return True


def delete(entry: epath.Path) -> None:
  """Deletes one leftover entry, never following a symlink out of its directory.

  The only place leftovers are deleted; it is `safe_io.remove_tree`, which
  unlinks a link (or file, FIFO...) itself and empties a directory through
  descriptors, deleting links inside as links.
  """
  safe_io.remove_tree(entry)


# ---- Reporting. -------------------------------------------------------------


def summary(leftovers: list[Leftover], where: epath.PathLike) -> str | None:
  """One line for ``pz-persist ls`` / ``inspect``: what was found, what to run."""
  if not leftovers:
    return None
  nbytes = sum(leftover.nbytes for leftover in leftovers)
  dead = sum(leftover.removable for leftover in leftovers)
  return (
      f"note: {len(leftovers)} leftover(s) of unfinished saves beside or in"
      f" {where} ({terminal.size_text(nbytes)}, {dead} removable now); see"
      f" `pz-persist clean {where}`"
  )


def only_trace(store: stores.Store, path: epath.Path) -> str:
  """What unfinished saves of ``path`` left, for the error saying that no
  checkpoint is there ('' if they left nothing).

  Why: a killed save leaves its family under hidden names beside the path
  (hundreds of MB of them), and a load saying only that the path does not
  exist sends the user looking for a checkpoint that was never finished.
  This says how much is left, where, and what removes it. Also Orbax's
  unfinished step of a ``CheckpointManager`` run (``RUN/2`` asked for, only
  ``RUN/2.orbax-checkpoint-tmp`` there). Never raises: it only adds to an
  error already on its way.
  """
  try:
    found = find(store, path)
    steps_left = [
        leftover for leftover in find_inside(store, path.parent)
        if leftover.name.name.startswith(path.name + _TMP_SUFFIX)
    ] if store.has_locks else []
  except (OSError, errors.PzPersistError):
    return ""
  found += steps_left
  if not found:
    return ""
  cleaned = path.parent if steps_left else path  # Steps are cleaned from their run.
  size = terminal.size_text(sum(leftover.nbytes for leftover in found))
  names = ", ".join(leftover.name.name for leftover in found)
  saves = "an interrupted save" if len(found) == 1 else f"{len(found)} interrupted saves"
  if any(leftover.status == "live" for leftover in found):
    fix = (" A save of it may still be running (its writer holds it): wait for it, or"
           f" stop it and run `pz-persist clean {cleaned}`.")
  elif all(leftover.removable for leftover in found):
    fix = f" Nothing of it can be loaded; `pz-persist clean {cleaned}` removes it."
  else:
    fix = (" Nothing of it can be loaded; once no process writes there,"
           f" `pz-persist clean --force {cleaned}` removes it (nothing proves its writer"
           " gone, so plain `pz-persist clean` keeps it).")
  return f" Its only trace is {saves} that never finished: {size} left in {names} in {path.parent}.{fix}"


# ---- Small helpers. ---------------------------------------------------------

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # Opening a FIFO must not wait for a writer.


def _family_parts(family: epath.Path) -> re.Match[str]:
  """The saved-to name, role and token of a family; refuses other names."""
  match = _FAMILY.match(family.name)
  if match is None:
    raise errors.ArgumentError(
        f"{family} is not named like the leftovers of an interrupted save"
        " (.NAME.pz_persist-new-TOKEN or .NAME.pz_persist-old-TOKEN); pass a"
        " Leftover that leftovers.find returned."
    )
  return match


def _marker(family: epath.Path) -> epath.Path:
  return family.parent / (family.name + MARKER_SUFFIX)


def _family_entries(target: epath.Path) -> list[epath.Path]:
  """Everything named after ``target`` beside it (itself included)."""
  try:
    names = os.listdir(os.fspath(target.parent))
  except OSError:
    return []
  return [
      target.parent / n for n in sorted(names)
      if n == target.name or n.startswith(target.name + ".")
  ]


def _this_writer() -> dict:
  """Who this process is, as recorded in markers."""
  return {
      "host": socket.gethostname(),
      "boot": _read("/proc/sys/kernel/random/boot_id").strip() or None,
      "pidns": _pidns(),
      "pid": os.getpid(),
      "start": _start_time(os.getpid()),
      "time": time.time(),
  }


def _pidns() -> str | None:
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return None


def _start_time(pid: int) -> int | None:
  """When process ``pid`` started (clock ticks since boot), where known.

  Tells a process from a later one that reuses its pid.
  """
  text = _read(f"/proc/{pid}/stat")
  if ")" not in text:
    return None
  fields = text.rsplit(")", 1)[1].split()
  try:
    return int(fields[19])  # Field 22 of stat; fields[0] is field 3.
  except (IndexError, ValueError):
    return None


def _pid_exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Exists, owned by another user.
  except OSError:
    return True  # Cannot tell: assume alive.
  return pid > 0


def _read(name: str) -> str:
  try:
    with open(name) as f:
      return f.read()
  except OSError:
    return ""
