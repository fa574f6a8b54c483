"""An Orbax ``TypeHandler`` for mutable ``pz.Parameter`` / ``pz.StateVariable``.

A Penzai model holding mutable variables is a pytree whose leaves are the
variable objects (variables are deliberately not pytree nodes). Plain Orbax
therefore meets ``pz.Parameter`` leaves and fails with "Unsupported type".
Registering `VariableTypeHandler` (done on import) lets Orbax's
``PyTreeCheckpointHandler`` save such trees as they are::

  import orbax.checkpoint as ocp
  import pz_persist  # registers the handler

  ocp.PyTreeCheckpointer().save(path, model)       # model has pz.Parameters
  restored = ocp.PyTreeCheckpointer().restore(path, item=model)

Each variable is saved frozen: its arrays go through Orbax's own ``jax.Array``
handler (a variable holding one array stores it under the leaf's own name, so
plain Orbax can read it as an array), and its label, metadata and axis names
go into a small JSON record written by the primary process, beside the item's
manifest (format 3: ``{leaf name: variable}``, the arrays under the names Orbax
stored them under), so `pz_persist.load`, ``inspect``, ``load_into(path,
model)``, ``migrate`` and the command read the item too. Saving is
`pz_persist.storage.writing.writer.encode_leaves`'s: this handler adapts it to Orbax's
``TypeHandler`` calls. Restoring rebuilds
a mutable variable of the same class; leaves that were the same variable object
when saved are the same object after restoring, so shared parameters stay
shared.

Restoring gives the guarantees of `pz_persist.load`: the directory is checked
for symlinks leading out and for FIFOs and devices first, the records are read
bounded and validated strictly (a `pz_persist.errors.ManifestError` names the
file and leaf at fault), each array's stored shape and dtype are checked
against its record and the total against the allocation limit before anything
is read, and the bytes read are checked against the checksums recorded when
they were saved (`pz_persist.errors.IntegrityError`). No variable is built
until every array has been read and checked. (``StandardCheckpointHandler`` refuses every custom leaf type; use
``PyTreeCheckpointHandler`` / ``ocp.args.PyTreeSave`` for such trees, or
`pz_persist.PenzaiSave`, which restores with no template at all.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import type_handlers
from orbax.checkpoint.metadata import value as value_metadata
from penzai import pz

from pz_persist import errors
from pz_persist import sharding as sharding_lib
from pz_persist.format import array_specs as arrays_lib
from pz_persist.format import manifest as manifest_lib
from pz_persist.format import nodes
from pz_persist.format import variable_kinds
from pz_persist.safety import safe_io
from pz_persist.storage.integrity import containment
from pz_persist.storage.integrity import orbax_metadata_checks
from pz_persist.storage.reading import reader
from pz_persist.storage.reading import restoring
from pz_persist.storage.writing import writer

_TYPESTR = "pz_persist.variable"
_KINDS = {name: kind.value_class for name, kind in variable_kinds.KINDS.items()}
_RECORD_FIELDS = {"kind", "tree", "arrays"}


def _renamed(info: type_handlers.ParamInfo, name: str) -> type_handlers.ParamInfo:
  new = info.replace(name=name)
  try:
    new.path = info.parent_dir / name
  except ValueError:
    pass  # Directory still being created: await_path_creation() sets the path.
  return new


@dataclasses.dataclass(frozen=True)
class _Saved:
  """One saved variable, as its record describes it (validated).

  Attributes:
    info: Orbax's ParamInfo of a leaf holding it (for its directory).
    kind: ``"parameter"`` or ``"state_variable"``.
    tree: The typed JSON node of its frozen value.
    specs: Its arrays; stored ones keyed by the name Orbax stores them under
      (unique in the checkpoint, unlike the per-record keys).
  """

  info: type_handlers.ParamInfo
  kind: str
  tree: nodes.Node
  specs: tuple[arrays_lib.ArraySpec, ...]


class VariableTypeHandler(type_handlers.TypeHandler):
  """Saves ``pz.Parameter`` / ``pz.StateVariable`` leaves (see module doc)."""

  def typestr(self) -> str:
    return _TYPESTR

  def _array_handler(self) -> type_handlers.TypeHandler:
    return type_handlers.get_type_handler(jax.Array)

  async def metadata(
      self, infos: Sequence[type_handlers.ParamInfo]
  ) -> Sequence[value_metadata.Metadata]:
    for info in infos:
      await info.await_path_creation()
    return [
        value_metadata.Metadata(name=info.name, directory=info.parent_dir)
        for info in infos
    ]

  async def serialize(
      self,
      values: Sequence[Any],
      infos: Sequence[type_handlers.ParamInfo],
      args: Sequence[type_handlers.SaveArgs] | None = None,
  ) -> Sequence[ocp.future.Future]:
    """Saves through `pz_persist.storage.writing.writer.encode_leaves`: Orbax's own
    ``jax.Array`` handler writes the arrays under the leaves' names; the
    primary process writes the records and the manifest."""
    saved = writer.encode_leaves([(info.name, value) for value, info in zip(values, infos)])
    info_of = {info.name: info for info in infos}
    futures = []
    if saved.stored:
      futures.extend(await self._array_handler().serialize(
          list(saved.stored.values()),
          [_renamed(info_of[saved.leaf_of_array[name]], name) for name in saved.stored],
      ))
    futures.append(
        ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_records(infos[0], saved), name="pz_persist_variable_records",
        )
    )
    return futures

  async def _write_records(self, info: type_handlers.ParamInfo, saved: writer.LeafSave) -> None:
    await info.await_path_creation()
    if ocp.multihost.is_primary_host(0):
      saved.write(info.parent_dir)

  async def deserialize(
      self,
      infos: Sequence[type_handlers.ParamInfo],
      args: Sequence[type_handlers.RestoreArgs] | None = None,
  ) -> Sequence[Any]:
    del args  # Placement follows pz_persist's default (the first device).
    for info in infos:
      await info.await_path_creation()
    directory = infos[0].parent_dir
    where = str(directory)
    # Before any file of the checkpoint is opened by pz_persist or TensorStore.
    containment.check_contained(directory)
    saved, same_as = _wanted(infos, _read_records(directory), where=where)
    values = await self._read_values(directory, saved)
    variables = {}
    for name, variable in saved.items():  # Built only once all were read.
      manifest_lib.check_typed_nodes(
          variable.tree, (), variable.specs, where=f"{where}: leaf {name!r}")
      frozen = restoring.decode(
          _manifest(variable.specs, variable.tree), values[name],
          where=f"{where}: leaf {name!r}",
      )
      expected = _KINDS[variable.kind]
      if type(frozen) is not expected:
        raise errors.ManifestError(
            f"{where}: leaf {name!r}: the record is not a {expected.__name__}."
        )
      variables[name] = frozen
    unfrozen = {name: frozen.unfreeze_as_copy() for name, frozen in variables.items()}
    return [unfrozen[same_as[info.name]] for info in infos]

  async def _read_values(
      self, directory: epath.Path, saved: Mapping[str, _Saved]
  ) -> dict[str, list[Any]]:
    """Every saved variable's arrays, read and checked, by variable name.

    Orbax's own ``jax.Array`` handler reads them (inside Orbax's event loop,
    under the names Orbax stores them under), but every check around the
    read is `pz_persist.storage.reading.reader`'s, as for `pz_persist.load`: stored shapes
    and dtypes against the records and the total bytes against the
    allocation limit before reading, checksums after.
    """
    where = str(directory)
    everything = _manifest(tuple(s for v in saved.values() for s in v.specs))
    read = reader.plan(everything, where=where)
    # Every array is restored as a jax.Array (its variable held one), where
    # pz_persist puts one by default: the first device.
    placement = sharding_lib.default_sharding()
    infos = {
        spec.key: _renamed(variable.info, spec.key)
        for variable in saved.values()
        for spec in variable.specs if spec.is_stored
    }
    keys = list(infos)
    stored: dict[str, Any] = {}
    if keys:
      handler = self._array_handler()
      try:
        metadata = await handler.metadata([infos[key] for key in keys])
      except (KeyboardInterrupt, MemoryError):
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        raise orbax_metadata_checks.unreadable_stored_metadata(directory, e) from None
      orbax_metadata_checks.check_stored_metadata(read.wanted, dict(zip(keys, metadata)), where=where)
      restore_args = [
          type_handlers.ArrayRestoreArgs(restore_type=jax.Array, sharding=placement)
      ] * len(keys)
      try:
        arrays = await handler.deserialize([infos[key] for key in keys], restore_args)
      except (KeyboardInterrupt, MemoryError):
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        raise reader.read_failure(everything, keys, where, e) from e
      stored = dict(zip(keys, arrays))
      reader.verify_checksums(read.wanted, stored, where=where)
    values = iter(reader.values(everything, stored, where=where, placed=read.placed))
    return {
        name: [next(values) for _ in variable.specs]
        for name, variable in saved.items()
    }


def _manifest(
    specs: tuple[arrays_lib.ArraySpec, ...], tree: nodes.Node | None = None
) -> manifest_lib.Manifest:
  """A manifest holding ``specs`` (and ``tree``): what `pz_persist.storage.reading.reader`
  plans reads from and `pz_persist.storage.reading.restoring` decodes."""
  return manifest_lib.Manifest(tree=tree or {}, variables=(), arrays=specs)


_Record = dict[str, Any]
"""One leaf's record, checked by `_valid_record`: ``{"same_as": leaf name}``
or ``{"kind", "tree", "arrays"}`` (its values JSON, read as checked)."""


def _read_records(directory: epath.Path) -> dict[str, tuple[str, _Record]]:
  """Every leaf's record: ``{leaf name: (file, record)}``, validated.

  Raises:
    ManifestError: a records file cannot be read or is malformed, or two
      files record the same leaf; the message names the file and leaf.
  """
  records: dict[str, tuple[str, _Record]] = {}
  for path in sorted(directory.glob(f"{writer.RECORDS_PREFIX}*.json")):
    where = str(path)
    for name, record in _parse_records(_read_bounded(path), where=where).items():
      if name in records:
        raise errors.ManifestError(
            f"{where}: leaf {name!r} also has a record in {records[name][0]}."
        )
      records[name] = (where, record)
  return records


def _read_bounded(path: epath.Path) -> bytes:
  """A records file, read by `safe_io.read_small_file` (no link followed, no
  FIFO or device opened, at most ``MAX_MANIFEST_BYTES``)."""
  try:
    return safe_io.read_small_file(
        path, manifest_lib.MAX_MANIFEST_BYTES, what="pz_persist variable record"
    )
  except OSError as e:
    raise errors.ManifestError(f"{path}: cannot be read: {e}") from None


def _parse_records(data: bytes, *, where: str) -> dict[str, _Record]:
  """Parses one records file strictly: ``{leaf name: record}``, with the
  manifest's bounds on values, objects and nesting (`manifest_lib.parse_json`:
  a records file holds the same nodes, and its writer checks it so too)."""
  parsed = manifest_lib.parse_json(data, where=where)
  if not isinstance(parsed, dict):
    raise errors.ManifestError(f"{where}: not a pz_persist variable record file.")
  for name, record in parsed.items():
    if not _valid_record(record):
      raise errors.ManifestError(
          f"{where}: leaf {name!r}: malformed record; expected"
          ' {"same_as": leaf name} or {"kind", "tree", "arrays"} with kind'
          f" one of {sorted(_KINDS)}."
      )
  return parsed


def _valid_record(record: object) -> bool:
  if not isinstance(record, dict):
    return False
  if set(record) == {"same_as"}:
    return isinstance(record["same_as"], str)
  return (
      set(record) == _RECORD_FIELDS
      and isinstance(record["kind"], str) and record["kind"] in _KINDS
      and isinstance(record["tree"], dict)
      and isinstance(record["arrays"], list)
  )


def _wanted(
    infos: Sequence[type_handlers.ParamInfo],
    records: Mapping[str, tuple[str, _Record]],
    *,
    where: str,
) -> tuple[dict[str, _Saved], dict[str, str]]:
  """The variables ``infos`` need, and which variable each leaf names.

  Returns:
    ``({variable name: saved variable}, {leaf name: variable name})``.
  """
  saved: dict[str, _Saved] = {}
  same_as: dict[str, str] = {}
  for info in infos:
    if info.name not in records:
      raise errors.ManifestError(
          f"{where}: no pz_persist record for leaf {info.name!r}; the"
          f" {writer.RECORDS_PREFIX}*.json files are missing or incomplete."
      )
    file, record = records[info.name]
    name = record.get("same_as", info.name)
    if name != info.name and (
        name not in records or "same_as" in records[name][1]
    ):
      raise errors.ManifestError(
          f"{file}: leaf {info.name!r} is recorded as the same variable as"
          f" {name!r}, which has no record of its own."
      )
    same_as[info.name] = name
    if name not in saved:
      saved[name] = _parse_saved(info, name, *records[name])
  return saved, same_as


def _parse_saved(
    info: type_handlers.ParamInfo, name: str, file: str, record: _Record
) -> _Saved:
  """One variable's record, its array entries validated; stored arrays are
  keyed by the name Orbax stores them under."""
  specs = [
      arrays_lib.ArraySpec.from_json(entry, where=f"{file}: leaf {name!r}: arrays[{i}]")
      for i, entry in enumerate(record["arrays"])
  ]
  if len({spec.key for spec in specs}) != len(specs):
    raise errors.ManifestError(f"{file}: leaf {name!r}: two arrays share a key.")
  stored = [spec for spec in specs if spec.is_stored]
  storage_names = {
      spec.key: writer.leaf_array_name(name, index, len(stored))
      for index, spec in enumerate(stored)
  }
  return _Saved(
      info=info,
      kind=record["kind"],
      tree=record["tree"],
      specs=tuple(
          dataclasses.replace(spec, key=storage_names[spec.key])
          if spec.key in storage_names else spec
          for spec in specs
      ),
  )


_HANDLER = VariableTypeHandler()


def register() -> None:
  """Registers the handler for Penzai's mutable variable classes (idempotent)."""
  type_handlers.register_type_handler(
      pz.Parameter,
      _HANDLER,
      func=lambda ty: isinstance(ty, type) and issubclass(ty, (pz.Parameter, pz.StateVariable)),
      override=True,
  )
