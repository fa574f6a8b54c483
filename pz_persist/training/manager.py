"""`CheckpointManager`: training checkpoints of Penzai values, built on Orbax's.

A training run must be able to stop at any moment and resume as if it never
stopped. Orbax's ``CheckpointManager`` already gives the hard parts: steps
committed atomically (a step directory appears whole or not at all, so a run
killed in the middle of a save leaves every earlier step loadable and the
latest step pointing at a complete one), asynchronous saves, retention and
metrics. This wrapper adds what Penzai users need on top: every item is a tree
pz_persist saves (parameters, optimizer state, RNG keys, data-iterator state,
anything `pz_persist.save` takes) and restores with no template; retention is
said in plain words; and an opt-in SIGTERM handler saves and exits when a
preemptible machine is about to be taken away.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from pz_persist import errors
from pz_persist import sharding as sharding_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import meshes
from pz_persist.orbax import v0_handler
from pz_persist.safety import allowlist
from pz_persist.safety import safe_io
from pz_persist.storage import orbax_seam
from pz_persist.storage import stores
from pz_persist.storage.integrity import containment
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.lifecycle import steps
from pz_persist.training import interrupted
from pz_persist.training import optimizers

_RESERVED_ITEMS = frozenset({"metrics", "descriptor", "_CHECKPOINT_METADATA"})

_TRASH = ".pz_persist_deleted"
"""Where steps dropped by retention are moved before being deleted (local runs).

Orbax deletes an old step file by file, in place: a run killed in the middle
leaves a step directory that still looks complete but is not. Moving the step
into this directory first is one atomic rename, so a step is either whole or
gone; the directory is then emptied in the background. On an object store
there is no rename (Orbax ignores this directory on GCS, and would copy the
step object by object on S3): there a step's commit marker is deleted first
instead (`_MarkerFirstDeleter`)."""

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit status after saving on SIGTERM (the shell's convention for SIGTERM)."""


class CheckpointManager:
  """Saves and restores training checkpoints of Penzai values by step.

  Example::

    import optax
    import pz_persist as pzp

    optimizer = optax.adam(optax.exponential_decay(1e-3, 1000, 0.5))
    with pzp.CheckpointManager("/tmp/run", max_to_keep=3) as manager:
      restored = manager.restore() if manager.latest_step() is not None else None
      ...
      for step in range(start, num_steps):
        params, opt_state, loss = train_step(params, opt_state, batch(step))
        manager.save(step, params=params, opt_state=opt_state,
                     data={"step": step}, metrics={"loss": float(loss)})

  Saves are asynchronous by default: `save` returns once the arrays are
  copied off the devices, and the writing goes on in the background (call
  `wait_until_finished` to wait). Only one save is in flight at a time.

  Args:
    directory: The run's directory (created if missing).
    max_to_keep: Keep the latest N steps (None: keep all).
    keep_best: Also keep the best N steps by ``best_metric``.
    best_metric: The metric (a key of the ``metrics`` dict passed to `save`)
      that ranks steps for ``keep_best`` and `best_step`.
    best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.
    keep_every_n_steps: Also keep every step divisible by N.
    save_interval_steps: `save` only saves every N steps (or when forced).
    async_save: Save in the background (default) or block until written.
    save_on_sigterm: On SIGTERM, the next call to `save` saves (whatever
      the interval), waits until the checkpoint is complete and exits the
      process with status 143. The default handler is restored by `close`.
    allow_modules: Extra modules saved trees may name classes from.
  """

  def __init__(
      self,
      directory: epath.PathLike,
      *,
      max_to_keep: int | None = None,
      keep_best: int | None = None,
      best_metric: str | None = None,
      best_mode: Literal["min", "max"] = "min",
      keep_every_n_steps: int | None = None,
      save_interval_steps: int = 1,
      async_save: bool = True,
      save_on_sigterm: bool = False,
      allow_modules: Iterable[str] | None = None,
  ):
    if keep_best is not None and best_metric is None:
      raise errors.ArgumentError("keep_best needs best_metric, the metric to rank steps by.")
    if best_mode not in ("min", "max"):
      raise errors.ArgumentError(f"best_mode must be 'min' or 'max', not {best_mode!r}.")
    self._allow_modules = tuple(allow_modules or ())
    self._best_metric = best_metric
    best_fn = _metric_getter(best_metric) if best_metric else None
    kept: list[policies.PreservationPolicy] = []
    if max_to_keep is not None:
      kept.append(policies.LatestN(n=max_to_keep))
    if keep_best is not None:
      kept.append(policies.BestN(
          get_metric_fn=best_fn, reverse=best_mode == "min", n=keep_best,
          keep_checkpoints_without_metrics=False,
      ))
    if keep_every_n_steps is not None:
      kept.append(policies.EveryNSteps(interval_steps=keep_every_n_steps))
    store, directory = stores.open_path(directory)  # Chosen once, for the run.
    self._remote = not store.renames  # Steps written in place.
    # Before Orbax reads step metadata or moves steps into the trash.
    self._check_run(directory)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    # Kept: an interrupted save is cancelled through it (`_abandon`).
    self._save_handler = v0_handler.PenzaiCheckpointHandler()
    registry.add(None, v0_handler.PenzaiSave, self._save_handler)
    registry.add(None, v0_handler.PenzaiRestore, v0_handler.PenzaiCheckpointHandler())
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            preservation_policy=policies.AnyPreservationPolicy(kept) if kept else None,
            best_fn=best_fn,
            best_mode=best_mode,
            cleanup_tmp_directories=True,
            todelete_subdir=None if self._remote else _TRASH,
            temporary_path_class=steps.temporary_path_class(store, directory),
            create=True,
        ),
        handler_registry=registry,
    )
    if self._remote:
      _delete_marker_first(self._manager, store, directory)
    # Held until close: `pz-persist clean` keeps the run's unfinished steps
    # (the step being written among them) while any manager holds it.
    try:
      self._run_hold = leftovers.hold_run(store, directory)
    except BaseException:
      self._manager.close()
      raise
    self._emptying: threading.Thread | None = None
    self._empty_trash_in_background()
    self._in_flight: list[int] = []  # Steps whose save has not ended yet.
    self._threads_before: set[threading.Thread] = set()  # When the first began.
    self._sigterm = threading.Event()
    self._previous_handler = None
    if save_on_sigterm:
      self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

  @staticmethod
  def _check_run(directory: epath.Path) -> None:
    """Refuses a run directory Orbax must not read or delete in.

    Why here: Orbax reads every step's metadata (unbounded, following links)
    when the manager opens and restores, and moves dropped steps into the
    trash; a link or FIFO there would make it read, block, or move steps
    wherever the run's writer chose. See `containment.check_run_directory`.
    """
    safe_io.check_own_directory(directory / _TRASH)
    containment.check_run_directory(directory)

  def _empty_trash(self) -> None:
    if ocp.multihost.is_primary_host(0) and not self._remote:
      safe_io.empty_directory(self._manager.directory / _TRASH)

  def _empty_trash_in_background(self) -> None:
    if self._emptying is not None and self._emptying.is_alive():
      return  # Already at it; what it misses is taken next time.
    self._emptying = threading.Thread(
        target=self._empty_trash, name="pz_persist_empty_trash", daemon=True
    )
    self._emptying.start()

  def _trash_has_entries(self) -> bool:
    """Whether retention left anything to delete (one directory listing)."""
    if self._remote:
      return False  # No trash there; see `_MarkerFirstDeleter`.
    try:
      return next(iter((self._manager.directory / _TRASH).iterdir()), None) is not None
    except OSError:
      return False

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self._sigterm.set()  # The next save() saves and exits; nothing heavy here.

  @property
  def directory(self) -> epath.Path:
    return self._manager.directory

  @property
  def sigterm_received(self) -> bool:
    """Whether SIGTERM arrived (with ``save_on_sigterm``); `save` will exit."""
    return self._sigterm.is_set()

  def save(
      self,
      step: int,
      *,
      metrics: Mapping[str, float] | None = None,
      force: bool = False,
      **items: object,
  ) -> bool:
    """Saves ``items`` (each any tree `pz_persist.save` takes) as ``step``.

    Every item is validated before anything is written. Returns whether a
    checkpoint was started: a step between ``save_interval_steps`` is skipped
    unless ``force``. After SIGTERM (with ``save_on_sigterm``), saves whatever
    the interval, waits until it is complete and exits the process.

    Args:
      step: The training step.
      metrics: Scalars to record with the step (used by ``keep_best``).
      force: Save even between intervals.
      **items: The trees to save, by item name.
    """
    if not items:
      raise errors.ArgumentError("save() needs at least one item, e.g. save(step, params=params).")
    reserved = _RESERVED_ITEMS & set(items)
    if reserved:
      raise errors.ArgumentError(f"item names {sorted(reserved)} are reserved by Orbax.")
    if self._best_metric and metrics is not None and self._best_metric not in metrics:
      raise errors.ArgumentError(f"metrics lack best_metric {self._best_metric!r}: {sorted(metrics)}")
    preempted = self._sigterm.is_set()
    if not (force or preempted or self._manager.should_save(step)):
      return False
    with allowlist.scoped_allowance(self._allow_modules):
      args = {name: v0_handler.PenzaiSave(tree) for name, tree in items.items()}
    safe_io.check_own_directory(self.directory / _TRASH)  # Retention moves there.
    if not self._in_flight:
      self._threads_before = set(threading.enumerate())
    self._in_flight.append(step)
    try:
      with interrupted.one_line(self._abandon):
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(**args),
            metrics=dict(metrics) if metrics is not None else None,
            force=force or preempted,
        )
    except Exception:
      self._in_flight = []  # A failed save is not in flight.
      raise
    # Orbax waited for the saves before this one; this one goes on if async.
    self._in_flight = [step] if saved and self._manager.is_saving_in_progress() else []
    if preempted:
      self.close()
      print(f"pz_persist: SIGTERM received; saved step {step} and exiting.", file=sys.stderr)
      sys.exit(SIGTERM_EXIT_CODE)
    if self._trash_has_entries():  # Most saves leave none: a thread start
      self._empty_trash_in_background()  # would hold the loop for nothing.
    return saved

  def restore(
      self,
      step: int | None = None,
      *,
      items: Iterable[str] | None = None,
      sharding: sharding_lib.Target = None,
      verify: bool = True,
      optimizer: optimizers.Optimizer | None = None,
      params_item: str = "params",
      opt_state_item: str = "opt_state",
      mesh: jax.sharding.Mesh | None = None,
  ) -> dict[str, Any]:
    """Restores a step's items, with no template.

    Optimizer states restore natively: optax's state classes are named in the
    checkpoint and optax is allow-listed, so a restored ``ScaleByAdamState``
    is a ``ScaleByAdamState``, schedule ``count`` included. Passing the
    ``optimizer`` additionally checks the restored state against
    ``jax.eval_shape(optimizer.init, params)`` and rebuilds it in exactly that
    structure; a different optimizer is a clear error, not a silent restart
    of its schedule.

    Args:
      step: The step (default: the latest).
      items: Names of the items to restore (default: all of the step's).
      sharding: Where ``jax.Array`` values go: a ``Sharding`` or
        `pz_persist.AxisRules` (default: the first device).
      verify: Check every array read against the checksum recorded when it
        was saved (`pz_persist.errors.IntegrityError` names damaged labels).
      optimizer: An optax ``GradientTransformation`` to check the optimizer
        state item against.
      params_item: The item holding the parameters (for ``optimizer``).
      opt_state_item: The item holding the optimizer state.
      mesh: The mesh that device meshes saved in the items become (see
        `pz_persist.load`); by default rebuilt over the devices at hand.

    Returns:
      ``{item name: restored tree}``.
    """
    self.wait_until_finished()
    self._check_run(self.directory)
    if step is None:
      step = self.latest_step()
      if step is None:
        raise errors.NotACheckpointError(f"{self.directory} has no checkpoint yet.")
    if step not in self.all_steps():
      raise errors.NotACheckpointError(
          f"{self.directory} has no step {step}; it has {self.all_steps()}."
      )
    available = self.item_names(step)
    names = list(available if items is None else items)
    unknown = sorted(set(names) - set(available))
    if unknown:
      raise errors.NotACheckpointError(
          f"step {step} of {self.directory} has no item(s) {unknown}; it has {available}."
      )
    with allowlist.scoped_allowance(self._allow_modules), meshes.using(mesh):
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              **{name: v0_handler.PenzaiRestore(sharding=sharding, verify=verify)
                 for name in names}
          ),
      )
    result = {name: restored[name] for name in names}
    if optimizer is not None:
      for needed in (params_item, opt_state_item):
        if needed not in result:
          raise errors.ArgumentError(f"optimizer= needs the {needed!r} item, which was not restored.")
      result[opt_state_item] = optimizers.check_state(
          result[opt_state_item], optimizer, result[params_item],
          where=f"{self.directory} step {step}",
      )
    return result

  def item_names(self, step: int) -> list[str]:
    """The items pz_persist saved in ``step``."""
    step_dir = self.directory / str(step)
    if not step_dir.is_dir():
      return []
    return sorted(
        p.name for p in step_dir.iterdir()
        if p.is_dir() and manifest_lib.has_manifest(p)
    )

  def all_steps(self) -> list[int]:
    """The committed steps, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step (never a partial one)."""
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """The step with the best ``best_metric`` (the latest if none is set)."""
    return self._manager.best_step()

  def metrics(self, step: int) -> dict[str, Any] | None:
    """The metrics saved with ``step``."""
    self._check_run(self.directory)  # Orbax reads them from the step.
    return self._manager.metrics(step)

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight (if any) is complete.

    Interrupted (Ctrl-C), it stops that save instead, and says in one line
    which steps are intact (see `pz_persist.training.interrupted`).
    """
    with interrupted.one_line(self._abandon):
      self._manager.wait_until_finished()
    self._in_flight = []

  def _abandon(self) -> str | None:
    """Stops the saves in flight after Ctrl-C, removes what they left of
    their steps, and returns the line saying what is intact (None if no
    save was in flight).

    As `pz_persist.save` does: Orbax's background work is cancelled and
    waited for (so no write lands after this, and none runs as a script
    exits), and an unfinished step is deleted only once every write to it
    has ended; otherwise it stays for ``pz-persist clean --force``.
    """
    unsaved, self._in_flight = self._in_flight, []
    if not unsaved:
      return None
    settled = leftovers.cancel_background(self._save_handler.cancel, self._threads_before)
    with contextlib.suppress(Exception):  # Its error is the cancellation.
      self._manager.wait_until_finished()  # Its finalize thread, ended by it.
    self._manager.reload()
    found = steps.list_steps(self.directory, commit_times=False)
    committed = sorted(info.step for info in found if info.committed)
    left = [info.path for info in found if not info.committed and info.step in unsaved]
    if settled and not self._remote and ocp.multihost.is_primary_host(0):
      for path in left:
        with contextlib.suppress(OSError):
          leftovers.delete(path)
      left = [path for path in left if path.exists()]
    return _interrupted_line(self.directory, unsaved, committed, left)

  def close(self) -> None:
    """Waits for the save in flight, releases resources, restores SIGTERM."""
    self.wait_until_finished()
    self._manager.close()
    leftovers.release_run(self._run_hold)
    self._run_hold = None
    if self._emptying is not None:
      self._emptying.join()
    try:
      self._empty_trash()
    finally:  # Even when the trash is refused.
      if self._previous_handler is not None:
        signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _steps_text(numbers: list[int]) -> str:
  if not numbers:
    return "no step"
  return f"step{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"


def _interrupted_line(
    directory: epath.Path, unsaved: list[int], committed: list[int], left: list[epath.Path]
) -> str:
  """The one line an interrupted `CheckpointManager` save shows."""
  whole = [step for step in unsaved if step in committed]
  lost = [step for step in unsaved if step not in committed]
  said = [f"pz_persist.CheckpointManager({str(directory)!r}).save interrupted;"
          f" {_steps_text(committed)} intact there"]
  if whole:
    said.append(f"{_steps_text(whole)} saved whole all the same (its writes had finished)")
  if lost and left:
    said.append(
        f"{_steps_text(lost)} not saved: its unfinished {', '.join(p.name for p in left)}"
        f" stays, which `pz-persist clean --force {directory}` removes once this"
        " process has ended"
    )
  elif lost:
    said.append(f"{_steps_text(lost)} not saved, and what it had written was removed")
  return "; ".join(said) + "."


class _MarkerFirstDeleter:
  """Orbax's step deleter for runs on object stores: a step whole or gone.

  Orbax deletes a dropped step there object by object, its commit marker
  among the others in listing order, so a run killed meanwhile (or a reader
  listing the steps meanwhile) could see a step still committed with files
  missing. `steps.remove_step` deletes the marker first. Orbax has no public
  hook for this; its deleter (the `CheckpointDeleter` protocol: ``delete``,
  ``delete_steps``, ``close``) is swapped by `_delete_marker_first`, through
  `orbax_seam.replace_step_deleter`.
  """

  def __init__(self, store: stores.Store, directory: epath.Path):
    self._store = store
    self._directory = directory

  def delete(self, step: int) -> None:
    if ocp.multihost.is_primary_host(0):  # As Orbax's: one process deletes.
      steps.remove_step(self._store, self._directory / str(step))

  def delete_steps(self, dropped: Iterable[int]) -> None:
    for step in dropped:
      self.delete(step)

  def close(self) -> None:
    pass


def _delete_marker_first(
    manager: ocp.CheckpointManager, store: stores.Store, directory: epath.Path
) -> None:
  """Makes ``manager`` delete steps with `_MarkerFirstDeleter`.

  Raises:
    UnsupportedStorageError: this Orbax keeps its deleter elsewhere (a
      version pz_persist was not tested with): refused rather than leaving
      Orbax's object-by-object deletion in place unnoticed.
  """
  if not orbax_seam.has_step_deleter(manager):
    raise errors.UnsupportedStorageError(
        f"{directory}: this orbax-checkpoint ({ocp.__version__}) does not let"
        " pz_persist delete a dropped step whole-or-gone on an object store;"
        " install a version it supports: pip install"
        f" 'orbax-checkpoint{orbax_seam.SUPPORTED_ORBAX}'."
    )
  orbax_seam.replace_step_deleter(manager, _MarkerFirstDeleter(store, directory))


def _metric_getter(name: str):
  def get(metrics: Mapping[str, float]) -> float:
    return float(metrics[name])

  return get
