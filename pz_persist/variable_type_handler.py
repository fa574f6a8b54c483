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
go into a small JSON record written by the primary process. Restoring rebuilds
a mutable variable of the same class; leaves that were the same variable object
when saved are the same object after restoring, so shared parameters stay
shared. (``StandardCheckpointHandler`` refuses every custom leaf type; use
``PyTreeCheckpointHandler`` / ``ocp.args.PyTreeSave`` for such trees, or
`pz_persist.PenzaiSave`, which restores with no template at all.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers
from orbax.checkpoint.metadata import value as value_metadata
from penzai import pz

from pz_persist import arrays as arrays_lib
from pz_persist import bounded_json
from pz_persist import encoding
from pz_persist import errors
from pz_persist import manifest as manifest_lib
from pz_persist import restoring
from pz_persist import sharding as sharding_lib

_RECORDS_PREFIX = "pz_persist_variables-"
_TYPESTR = "pz_persist.variable"


def _array_name(leaf_name: str, index: int, count: int) -> str:
  # A one-array variable (the usual case) stores it under the leaf's own name.
  return leaf_name if count == 1 else f"{leaf_name}.pz{index}"


def _renamed(info: type_handlers.ParamInfo, name: str) -> type_handlers.ParamInfo:
  new = info.replace(name=name)
  try:
    new.path = info.parent_dir / name
  except ValueError:
    pass  # Directory still being created: await_path_creation() sets the path.
  return new


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
    records: dict[str, Any] = {}
    first_name_of: dict[int, str] = {}
    arrays, array_infos = [], []
    for variable, info in zip(values, infos):
      if id(variable) in first_name_of:
        records[info.name] = {"same_as": first_name_of[id(variable)]}
        continue
      first_name_of[id(variable)] = info.name
      encoded = encoding.encode(variable.freeze(), root=f"leaf {info.name!r}")
      stored = [
          (spec, value)
          for spec, value in zip(encoded.arrays, encoded.values)
          if spec.is_stored
      ]
      for index, (spec, value) in enumerate(stored):
        if spec.kind != "jax":
          value = jax.numpy.asarray(value)
        arrays.append(value)
        array_infos.append(_renamed(info, _array_name(info.name, index, len(stored))))
      records[info.name] = {
          "kind": "parameter" if isinstance(variable, pz.Parameter) else "state_variable",
          "tree": encoded.tree,
          "arrays": [spec.to_json() for spec in encoded.arrays],
      }
    futures = []
    if arrays:
      futures.extend(await self._array_handler().serialize(arrays, array_infos))
    futures.append(
        ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_records(infos[0], records),
            name="pz_persist_variable_records",
        )
    )
    return futures

  async def _write_records(
      self, info: type_handlers.ParamInfo, records: dict[str, Any]
  ) -> None:
    await info.await_path_creation()
    if ocp.multihost.is_primary_host(0):
      path = info.parent_dir / f"{_RECORDS_PREFIX}{uuid.uuid4().hex}.json"
      path.write_text(json.dumps(records, allow_nan=False))

  def _read_records(self, info: type_handlers.ParamInfo) -> dict[str, Any]:
    records = {}
    for path in info.parent_dir.glob(f"{_RECORDS_PREFIX}*.json"):
      loaded = bounded_json.load_file(
          path, max_bytes=manifest_lib.MAX_MANIFEST_BYTES,
          max_nodes=manifest_lib.MAX_MANIFEST_NODES,
          max_depth=manifest_lib.MAX_JSON_DEPTH,
      )
      if not isinstance(loaded, dict):
        raise errors.ManifestError(f"{path}: not a JSON object of records.")
      records.update(loaded)
    return records

  async def deserialize(
      self,
      infos: Sequence[type_handlers.ParamInfo],
      args: Sequence[type_handlers.RestoreArgs] | None = None,
  ) -> Sequence[Any]:
    del args  # Placement follows pz_persist's default (the first device).
    for info in infos:
      await info.await_path_creation()
    records = self._read_records(infos[0])
    wanted = {}
    for info in infos:
      name = info.name
      record = records.get(name)
      if isinstance(record, dict) and "same_as" in record:
        name = record["same_as"]
        record = records.get(name)
      if (
          not isinstance(record, dict) or set(record) != {"kind", "tree", "arrays"}
          or not isinstance(record["arrays"], list)
      ):
        raise errors.ManifestError(
            f"{info.parent_dir}: no valid pz_persist record for leaf {info.name!r}."
        )
      wanted.setdefault(name, (info, record))

    placement = sharding_lib.default_sharding()
    arrays, array_infos, array_args, owners = [], [], [], []
    parsed = {}
    for name, (info, record) in wanted.items():
      specs = [
          arrays_lib.ArraySpec.from_json(entry, where=f"leaf {name!r}")
          for entry in record["arrays"]
      ]
      parsed[name] = (record, specs)
      stored = [spec for spec in specs if spec.is_stored]
      for index, spec in enumerate(stored):
        array_infos.append(_renamed(info, _array_name(name, index, len(stored))))
        array_args.append(
            type_handlers.ArrayRestoreArgs(restore_type=jax.Array, sharding=placement)
        )
        owners.append((name, spec.key))
    if array_infos:
      arrays = await self._array_handler().deserialize(array_infos, array_args)
    read: dict[str, dict[str, Any]] = {}
    for (name, key), value in zip(owners, arrays):
      read.setdefault(name, {})[key] = value

    variables = {}
    for name, (record, specs) in parsed.items():
      if record["kind"] not in ("parameter", "state_variable"):
        raise errors.ManifestError(f"leaf {name!r}: unknown kind {record['kind']!r}.")
      frozen = restoring.assemble(
          manifest_lib.Manifest(tree=record["tree"], variables=(), arrays=tuple(specs)),
          read.get(name, {}),
          where=f"leaf {name!r}",
      )
      expected = pz.ParameterValue if record["kind"] == "parameter" else pz.StateVariableValue
      if type(frozen) is not expected:
        raise errors.ManifestError(f"leaf {name!r}: record is not a {expected.__name__}.")
      variables[name] = frozen.unfreeze_as_copy()
    result = []
    for info in infos:
      record = records[info.name]
      name = record["same_as"] if "same_as" in record else info.name
      result.append(variables[name])
    return result


_HANDLER = VariableTypeHandler()


def register() -> None:
  """Registers the handler for Penzai's mutable variable classes (idempotent)."""
  type_handlers.register_type_handler(
      pz.Parameter,
      _HANDLER,
      func=lambda ty: isinstance(ty, type) and issubclass(ty, (pz.Parameter, pz.StateVariable)),
      override=True,
  )
