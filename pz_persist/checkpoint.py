"""`save`, `load` and `inspect`: a Penzai tree to a directory and back.

A checkpoint written by `save` is an ordinary Orbax checkpoint with one item,
``penzai``, written through `pz_persist.orbax_v0.PenzaiCheckpointHandler`::

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
by the next save of the path (see `pz_persist.leftovers`).

`load` and `inspect` accept that directory, the ``penzai`` item directory
inside it, or any Orbax checkpoint directory with exactly one pz_persist item
(such as a `CheckpointManager` step written with `pz_persist.PenzaiSave`).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from pz_persist import allowlist
from pz_persist import directories
from pz_persist import errors
from pz_persist import leftovers
from pz_persist import manifest as manifest_lib
from pz_persist import orbax_v0
from pz_persist import progress as progress_lib
from pz_persist import restoring
from pz_persist import safe_io
from pz_persist import safety
from pz_persist import sharding as sharding_lib

ITEM_NAME = "penzai"
"""Name of the Orbax item `save` writes the tree to."""

_ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"


def save(
    path: epath.PathLike,
    tree: Any,
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
      `pz_persist.leftovers`), and says so in one line.
  """
  path = directories.as_path(path)
  seen = directories.identity(path)  # Moved into place only if still this.
  if seen is not None and not overwrite:
    raise errors.CheckpointExistsError(
        f"{path} already exists; pass overwrite=True to replace it."
    )
  if seen is not None:
    _check_replaceable(path)
  with allowlist.scoped_allowance(allow_modules):
    args = orbax_v0.PenzaiSave(tree)  # Validates the whole tree now.
  # With several processes (jax.distributed), all write their shards of the
  # same checkpoint; only the primary process moves directories.
  primary = ocp.multihost.is_primary_host(0)
  if primary:
    path.parent.mkdir(parents=True, exist_ok=True)
    leftovers.remove_dead(path)  # Of earlier saves of ``path`` that died.
  # Always written whole under a name of its own, never at ``path`` directly:
  # Orbax's temporary name (``path.orbax-checkpoint-tmp``) would be shared by
  # two saves of ``path``, each deleting the other's files.
  target = directories.sibling(path, "new", _shared_token())
  handler = orbax_v0.PenzaiCheckpointHandler()
  outcome, failure = None, None
  try:
    # On any exception (Ctrl-C included), `writing` stops Orbax's background
    # work and deletes what this save wrote before the exception goes on.
    with leftovers.writing(target, cancel=handler.cancel, primary=primary):
      with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{ITEM_NAME: handler})) as checkpointer:
        checkpointer.save(target, args=ocp.args.Composite(**{ITEM_NAME: args}))
      if primary:
        with leftovers.interrupts_deferred():  # The move is all or nothing.
          try:
            moved = directories.move_into_place(path, target, seen)
            outcome = _MOVED if moved else _LOST_RACE
          except Exception as e:  # pylint: disable=broad-exception-caught
            outcome, failure = _FAILED, e  # Raised once the others know.
  except KeyboardInterrupt:
    raise errors.save_interrupted(_interrupted(path, seen, outcome)) from None
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


def _interrupted(path: epath.Path, seen: directories.Identity, outcome: int | None) -> str:
  """The one line an interrupted `save` shows: what is at ``path`` now."""
  if outcome == _MOVED:
    return (f"pz_persist.save({str(path)!r}) was interrupted once complete:"
            " the new checkpoint is in place.")
  kept = f"{path} is unchanged" if seen is not None else f"nothing was written at {path}"
  return f"pz_persist.save({str(path)!r}) interrupted; it removed what it had written and {kept}."


def _shared_token() -> str:
  """A random name part, the same in every process."""
  token = np.int64(uuid.uuid4().int % 2**62)
  if jax.process_count() > 1:
    token = ocp.multihost.broadcast_one_to_all(token)
  return f"{int(token):016x}"


def load(
    path: epath.PathLike,
    *,
    sharding: sharding_lib.Target = None,
    verify: bool = True,
    allow_modules: Iterable[str] | None = None,
    progress: progress_lib.Progress = None,
) -> Any:
  """Loads a tree saved by `save` (or through `PenzaiSave`), with no template.

  Example::

    params = pzp.load("/tmp/mlp_params")
    model = pz.bind_variables(unbound_mlp, params)

  Args:
    path: A checkpoint directory, or the item directory inside one.
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
      `_LOAD_ATTEMPTS` attempts to read it.
  """
  # Files are read by path, so a save replacing the checkpoint while it is
  # read could mix the old manifest with new arrays, or fail on files of the
  # old one as it is deleted. On a local disk the read holds a shared lock
  # that a save's final move waits for; elsewhere (or when the item directory
  # itself was given) such a read is detected (what is at the item's path
  # changed while it was read) and done again from the start.
  path = directories.as_path(path)
  failure = None
  for _ in range(_LOAD_ATTEMPTS):
    item = None
    with directories.reading(path):
      before = _identity(path, item)
      try:
        item = find_item(path)
        before = _identity(path, item)
        with allowlist.scoped_allowance(allow_modules):
          handler = orbax_v0.PenzaiCheckpointHandler()
          try:
            tree = handler.restore(
                item, orbax_v0.PenzaiRestore(sharding=sharding, verify=verify,
                                             progress=progress)
            )
          finally:
            handler.close()
      except Exception as e:  # pylint: disable=broad-exception-caught
        if _identity(path, item) == before:
          raise  # The checkpoint did not change: a real error.
        failure = e
        continue
      unchanged = _identity(path, item) == before
    if unchanged:
      return tree
  raise errors.ConcurrentSaveError(
      f"{path} was replaced by other saves while each of {_LOAD_ATTEMPTS}"
      " attempts to load it was reading it; try again."
  ) from failure


_LOAD_ATTEMPTS = 3
"""How many times `load` reads a checkpoint that other saves keep replacing."""


def _identity(path: epath.Path, item: epath.Path | None) -> tuple[Any, ...]:
  """Which checkpoint is at ``path`` (and its ``item``, once found) now.

  A save replacing it puts new directories there, with new inodes and times;
  the manifest's hash covers filesystems without stable inodes.
  """
  if item is None:
    return (directories.identity(path),)
  try:  # Bounded, never following a link nor blocking, as in read.
    digest = hashlib.sha256(safe_io.read_small_file(
        manifest_lib.manifest_path(item), manifest_lib.MAX_MANIFEST_BYTES
    )).digest()
  except (OSError, errors.PzPersistError):
    digest = None
  return directories.identity(path), directories.identity(item), digest


def inspect(
    path: epath.PathLike, *, allow_modules: Iterable[str] | None = None
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
    path: A checkpoint directory, or the item directory inside one.
    allow_modules: As for `load`.
  """
  item = find_item(path)
  with allowlist.scoped_allowance(allow_modules):
    return restoring.abstract_tree(manifest_lib.read(item), where=str(item))


def read_manifest(path: epath.PathLike) -> manifest_lib.Manifest:
  """The validated manifest of the checkpoint at ``path`` (reads no arrays)."""
  return manifest_lib.read(find_item(path))


def find_item(path: epath.PathLike) -> epath.Path:
  """The pz_persist item directory of the checkpoint at ``path``.

  Raises:
    NotACheckpointError: no item, or several (the message lists them).
  """
  path = directories.as_path(path)
  if not path.is_dir():
    raise errors.NotACheckpointError(
        f"{path} is not a pz_persist checkpoint: "
        + ("it is not a directory." if path.exists() else "it does not exist.")
    )
  if _holds_manifest(path):
    safety.check_contained(path)
    manifest_lib.check_file(path)
    return path
  items = sorted(
      child for child in path.iterdir()
      if child.is_dir() and _holds_manifest(child)
  )
  if len(items) == 1:
    # The whole checkpoint, not only the item: the item directory itself may
    # be a symlink leading out of it.
    safety.check_contained(path)
    safety.check_checkpoint_metadata(path)
    manifest_lib.check_file(items[0])
    return items[0]
  if len(items) > 1:
    names = ", ".join(item.name for item in items)
    raise errors.NotACheckpointError(
        f"{path} holds several pz_persist items ({names}); pass one of them,"
        f" e.g. {items[0]}."
    )
  hint = ""
  if (path / _ORBAX_CHECKPOINT_METADATA).exists() or (path / "_METADATA").exists():
    hint = (
        " It is an Orbax checkpoint written without pz_persist; restore it with"
        " orbax.checkpoint and a template or, if it holds a Penzai model's"
        " parameters (saved from pz.unbind_params(model, freeze=True)), load it"
        " with pz_persist.load_model(path, into=model) or convert it with"
        " pz_persist.migrate."
    )
  raise errors.NotACheckpointError(
      f"{path} is not a pz_persist checkpoint: no {manifest_lib.MANIFEST_FILENAME}"
      f" in it or in any directory directly inside it.{hint}"
  )


def _holds_manifest(directory: epath.Path) -> bool:
  """Whether ``directory`` has a manifest entry of any kind.

  Why not `manifest.has_manifest`: a manifest that is a symlink out of the
  checkpoint, a FIFO or a directory is not a regular file, and would make
  the directory look like no checkpoint at all; found here, it is refused by
  name instead (by `safety.check_contained` or `manifest.read`).
  """
  if not directories.is_local(directory):
    return manifest_lib.has_manifest(directory)
  return os.path.lexists(os.fspath(manifest_lib.manifest_path(directory)))


def _check_replaceable(path: epath.Path) -> None:
  """Refuses to replace anything but a pz_persist checkpoint or empty dir."""
  if not path.is_dir():
    raise errors.CheckpointExistsError(
        f"{path} exists and is not a directory; refusing to replace it."
    )
  if not any(path.iterdir()):
    return
  try:
    find_item(path)
  except errors.NotACheckpointError:
    raise errors.CheckpointExistsError(
        f"{path} exists and is not a pz_persist checkpoint; refusing to"
        " replace it even with overwrite=True. Remove it yourself if you mean to."
    ) from None


