"""`save`, `load` and `inspect`: a Penzai tree to a directory and back.

A checkpoint written by `save` is an ordinary Orbax checkpoint with one item,
``penzai``, written through `pz_persist.orbax.v0_handler.PenzaiCheckpointHandler`::

  path/
    _CHECKPOINT_METADATA   Orbax: names the handler of each item
    penzai/
      pz_persist.json      the manifest (tree structure, labels, axes, dtypes,
                           a checksum per array shard)
      pz_persist.files.json   size and checksum of every file of the item
      _METADATA, manifest.ocdbt, d/...   the arrays, as Orbax writes them

A checkpoint appears whole or not at all: `save` writes it completely under a
hidden sibling name and then renames it into place, or, replacing one
(``overwrite=True``), atomically swaps it with the old one, which survives
until the new one is complete. When two processes save to one path at once,
one wins and the other gets `pz_persist.errors.ConcurrentSaveError`; a `load`
running meanwhile returns the old or the new checkpoint, never a mix of both.
An interrupted save deletes what it wrote; what a killed one left is deleted
by the next save of the path (see `pz_persist.storage.lifecycle.leftovers`).

`load` and `inspect` accept that directory, the ``penzai`` item directory
inside it, or any Orbax checkpoint directory with exactly one pz_persist item
(such as a `CheckpointManager` step written with `pz_persist.PenzaiSave`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from pz_persist import errors
from pz_persist import progress as progress_lib
from pz_persist import sharding as sharding_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import meshes
from pz_persist.orbax import v0_handler
from pz_persist.safety import allowlist
from pz_persist.storage import destinations
from pz_persist.storage import stores
from pz_persist.storage.lifecycle import leftovers
from pz_persist.storage.lifecycle import steps
from pz_persist.storage.reading import opening
from pz_persist.storage.reading import restoring

ITEM_NAME = "penzai"
"""Name of the Orbax item `save` writes the tree to."""

def save(
    path: epath.PathLike,
    tree: object,
    *,
    overwrite: bool = False,
    allow_modules: Iterable[str] | None = None,
) -> None:
  """Saves a tree of Penzai values to a new checkpoint directory.

  The tree may hold ``NamedArray`` / ``NamedArrayView`` values, frozen
  ``ParameterValue`` / ``StateVariableValue`` objects or mutable
  ``pz.Parameter`` / ``pz.StateVariable`` ones (a variable used in two places
  stays one variable), their slots, JAX and NumPy arrays of any dtype
  (bfloat16, float8, int4, PRNG keys...), Python scalars, strings, None, and
  dict / list / tuple / namedtuple containers. `load` gives it back with no
  template: same classes, axis names, labels, metadata, dtypes and bits.

  Everything is validated before anything is written: a value that cannot be
  saved raises `pz_persist.errors.EncodingError` naming its place in the tree
  and its label.

  Example::

    import jax
    import pz_persist as pzp
    from penzai import pz
    from penzai.models import simple_mlp

    mlp = simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[8, 32, 8]
    )
    _, params = pz.unbind_params(mlp, freeze=True)
    pzp.save("/tmp/mlp_params", params, overwrite=True)

  Args:
    path: Directory to create. Its parent is created if needed.
    tree: The tree to save.
    overwrite: Replace an existing checkpoint at ``path``. Only a pz_persist
      checkpoint or an empty directory is ever replaced.
    allow_modules: Extra modules whose classes (namedtuples, Enums) the tree
      may hold, for this call only; see `pz_persist.allow_modules`.

  Raises:
    CheckpointExistsError: ``path`` exists and ``overwrite`` is False.
    ConcurrentSaveError: another process saved ``path`` while this save was
      writing; its checkpoint is kept and nothing of this save is.
    EncodingError: a value cannot be saved (nothing was written).
    DisallowedModuleError: a class comes from a module that is not allowed.
    KeyboardInterrupt: the save was interrupted (Ctrl-C); it stopped Orbax's
      background writing and deleted what it wrote (see
      `pz_persist.storage.lifecycle.leftovers`), and says so in one line.
  """
  store, path = stores.open_path(path)  # Chosen once, for the whole save.
  destinations.check_outside_checkpoints(store, path, path)  # Never inside another.
  seen = store.identity(path)  # Moved into place only if still this.
  if seen is not None and not overwrite:
    raise errors.CheckpointExistsError(
        f"{path} already exists; pass overwrite=True to replace it."
    )
  if seen is not None and seen[0] != "commit":  # A commit: pz_persist's own.
    destinations.check_replaceable(store, path, "checkpoint")
  store.check_publishable(path, seen)
  with allowlist.scoped_allowance(allow_modules):
    args = v0_handler.PenzaiSave(tree)  # Validates the whole tree now.
  # With several processes (jax.distributed), all write their shards of the
  # same checkpoint; only the primary process moves directories.
  primary = ocp.multihost.is_primary_host(0)
  if primary and store.renames:  # Into a sibling, renamed into place.
    path.parent.mkdir(parents=True, exist_ok=True)
    leftovers.remove_dead(store, path)  # Of earlier saves of ``path`` that died.
  # Always written whole under a name of its own, never at ``path`` directly:
  # Orbax's temporary name (``path.orbax-checkpoint-tmp``) would be shared by
  # two saves of ``path``, each deleting the other's files. On an object
  # store that name is a ``gen-*`` folder inside ``path``, published by a
  # commit object instead of moved (`pz_persist.storage.stores.commit_objects`).
  target = store.new_location(path, _shared_token())
  handler = v0_handler.PenzaiCheckpointHandler()
  outcome, failure = None, None
  state = leftovers.Writing(target)
  try:
    # On any exception (Ctrl-C included), `writing` stops Orbax's background
    # work and deletes what this save wrote before the exception goes on.
    with leftovers.writing(store, target, cancel=handler.cancel, primary=primary) as state:
      # Orbax's own ways of writing it, chosen here through its public hook
      # (`steps.temporary_path_class`): locally a rename of its own temporary
      # name; on an object store in place, with commit_success.txt (for s3://
      # once `stores.open_path` registered S3 with Orbax).
      with ocp.Checkpointer(
          ocp.CompositeCheckpointHandler(**{ITEM_NAME: handler}),
          temporary_path_class=steps.temporary_path_class(store, target),
      ) as checkpointer:
        checkpointer.save(target, args=ocp.args.Composite(**{ITEM_NAME: args}))
      if primary:
        with leftovers.interrupts_deferred():  # The move is all or nothing.
          try:
            moved = store.publish(path, target, seen)
            outcome = _MOVED if moved else _LOST_RACE
          except Exception as e:  # pylint: disable=broad-exception-caught
            outcome, failure = _FAILED, e  # Raised once the others know.
  except KeyboardInterrupt:
    raise errors.save_interrupted(_interrupted(path, seen, outcome, state.left)) from None
  outcome = _MOVED if outcome is None else outcome  # Others: the primary tells.
  if jax.process_count() > 1:  # Also keeps the others waiting for the move.
    outcome = int(ocp.multihost.broadcast_one_to_all(np.int32(outcome)))
  if failure is not None:
    raise failure
  if outcome == _LOST_RACE:
    raise errors.ConcurrentSaveError(
        f"another process saved {path} while this save was writing; nothing"
        " of this save was kept."
    )
  if outcome == _FAILED:
    raise errors.PzPersistError(
        f"saving {path}: the primary process failed to move the new checkpoint"
        " into place (see its error)."
    )


_MOVED, _LOST_RACE, _FAILED = 0, 1, 2


def _interrupted(
    path: epath.Path, seen: stores.base.Identity, outcome: int | None,
    left: tuple[epath.Path, ...] = (),
) -> str:
  """The one line an interrupted `save` shows: what is at ``path`` now, and
  what of the save stays beside it (``left``, see `leftovers.Writing`)."""
  if outcome == _MOVED:
    return (f"pz_persist.save({str(path)!r}) was interrupted once complete:"
            " the new checkpoint is in place.")
  kept = f"{path} is unchanged" if seen is not None else f"nothing was written at {path}"
  said = f"pz_persist.save({str(path)!r}) interrupted; {kept}"
  if not left:
    return f"{said} and it removed everything it had written."
  names = ", ".join(entry.name for entry in left)
  return (f"{said}; it removed what it had written but for {names} beside it (its writes"
          f" still under way fail there), which the next save of {path} or"
          f" `pz-persist clean {path}` removes.")


def _shared_token() -> str:
  """16 random hex digits, the same in every process.

  Two 32-bit halves: JAX's broadcast between processes carries 32-bit
  integers unless x64 is on, which turned one 62-bit number negative.
  """
  halves = np.frombuffer(uuid.uuid4().bytes[:8], np.uint32).astype(np.int32)
  if jax.process_count() > 1:
    halves = np.asarray(ocp.multihost.broadcast_one_to_all(halves))
  return "".join(f"{int(half) & 0xFFFFFFFF:08x}" for half in halves)


def load(
    path: opening.PathOrHandle,
    *,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
  r"""Loads a tree saved by `save` (or through `PenzaiSave`), with no template.

  Example::

    params = pzp.load("/tmp/mlp_params")
    model = pz.bind_variables(unbound_mlp, params)

  Args:
    path: A checkpoint directory, the item directory inside one, or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    sharding: Where ``jax.Array`` values go: a ``jax.sharding.Sharding``, or
      `pz_persist.AxisRules` to shard each array over a mesh by its axis
      names (default: the first local device).
      Arrays saved as NumPy arrays come back as NumPy arrays.
    verify: Check the bytes of every array read against the checksum
      recorded when it was saved, before the tree is built. Hashing
      (xxHash3-128) takes about 0.1 s per GiB, overlapped with the reading
      of the next arrays (see the benchmarks README); silent corruption
      costs far more, so it is on by default. Each process checks the saved
      shards that lie within what it reads; `pz_persist.verify` checks a
      whole checkpoint.
    allow_modules: Extra modules the checkpoint may name classes from, for
      this call only; see `pz_persist.allow_modules`.
    progress: None (default): a bar on stderr, if it is a terminal or in a
      notebook, once a load has taken a second; True: always; False: never;
      or a function called as ``progress(done, total)`` with the bytes read
      (`pz_persist.progress`).
    mesh: The ``jax.sharding.Mesh`` that device meshes saved in the tree
      (those of Penzai's ``ConstrainShardingByName`` layers, of
      ``NamedSharding``\ s) become; it must have their axis names. By default
      each is rebuilt from its axis names and sizes over the first devices
      of ``jax.devices()``, and refused (`pz_persist.errors.MeshError`) if
      there are too few.

  Returns:
    The saved tree. Mutable variables come back as new mutable variables
    (shared ones still shared); everything else as it was saved.

  Raises:
    NotACheckpointError: ``path`` holds no pz_persist checkpoint.
    FormatVersionError: the checkpoint needs a newer pz_persist.
    ManifestError: the checkpoint is damaged or inconsistent.
    DisallowedModuleError: it names a class from a module that is not allowed.
    IntegrityError: with ``verify``, arrays do not match their checksums.
    ConcurrentSaveError: other saves replaced the checkpoint during each of
      `pz_persist.storage.stores.base.Store.load_attempts` attempts to read it
      (10 on an object store, where no lock makes saves wait for readers).
  """
  # Opened as every read is: under the lock a save's final move waits for,
  # and read again if a save replaced the checkpoint meanwhile (`opening`).
  with allowlist.scoped_allowance(allow_modules), meshes.using(mesh):
    return opening.read(path, lambda opened: restoring.read_tree(
        opened, sharding=sharding, verify=verify, progress=progress
    ))


def inspect(
    path: opening.PathOrHandle, *, allow_modules: Iterable[str] | None = None
) -> Any:
  """The saved tree with ``jax.ShapeDtypeStruct`` for arrays; reads no arrays.

  Only the manifest is read, so this is fast on any checkpoint size. Mutable
  variables appear as their frozen values (``ParameterValue`` /
  ``StateVariableValue``), since a mutable variable cannot hold an abstract
  array. The result renders with treescope.

  Example::

    abstract = pzp.inspect("/tmp/mlp_params")
    print(abstract[0].label, abstract[0].value.named_axes)

  Args:
    path: A checkpoint directory, the item directory inside one, or a
      `pz_persist.open` handle (the checkpoint it opened is read).
    allow_modules: As for `load`.
  """
  with allowlist.scoped_allowance(allow_modules):
    return opening.read(path, v0_handler.abstract_tree)


def read_manifest(path: epath.PathLike) -> manifest_lib.Manifest:
  """The validated manifest of the checkpoint at ``path`` (reads no arrays)."""
  return opening.read_manifest(path)


def find_item(path: epath.PathLike) -> epath.Path:
  """The pz_persist item directory of the checkpoint at ``path``.

  Raises:
    NotACheckpointError: no item, or several (the message lists them).
  """
  return opening.find_item(*stores.open_path(path))[0]
