"""Former public spellings: each still finds its object, warns, and says when it goes.

Module-level aliases were removed (issue 38); the public ones are served by
`pz_persist.deprecations.module_getattr` until 2027-06-01. Every one listed
here must warn naming the new spelling and the date, and be the very object
the new spelling names.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

from pz_persist import deprecations

FORMER = {
    "pz_persist.binding.BindingError": "pz_persist.errors.BindingError",
    "pz_persist.orbax.v0_handler.DEFAULT_CHUNK_BYTES":
        "pz_persist.storage.writing.writer.DEFAULT_CHUNK_BYTES",
    "pz_persist.orbax.v0_handler.DEFAULT_READ_BATCH_BYTES":
        "pz_persist.storage.reading.reader.DEFAULT_READ_BATCH_BYTES",
    "pz_persist.orbax.v0_handler.LOAD_PROGRESS_DELAY":
        "pz_persist.storage.reading.reader.LOAD_PROGRESS_DELAY",
    "pz_persist.orbax.v0_handler.SETTLE_SECONDS": "pz_persist.storage.writing.writer.SETTLE_SECONDS",
    "pz_persist.orbax.v0_handler.encode_manifest": "pz_persist.storage.writing.writer.encode_hashed",
    "pz_persist.orbax.v0_handler.with_checksums": "pz_persist.storage.writing.writer.with_checksums",
}


@pytest.mark.parametrize("old,new", sorted(FORMER.items()))
def test_a_former_spelling_warns_and_is_the_same_object(old, new):
  module_name, _, name = old.rpartition(".")
  module = importlib.import_module(module_name)
  with pytest.warns(DeprecationWarning) as caught:
    value = getattr(module, name)
  message = str(caught[0].message)
  assert old in message and new in message and deprecations.REMOVAL in message
  assert caught[0].filename == __file__  # Points at the code using the old spelling.
  assert value is deprecations.resolve(new)


def test_other_names_are_still_attribute_errors():
  from pz_persist import binding  # pylint: disable=import-outside-toplevel

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(AttributeError, match="no attribute 'Bindingerror'"):
      binding.Bindingerror  # noqa: B018  # pylint: disable=pointless-statement
    assert not hasattr(binding, "no_such_name")


def test_the_date_is_the_projects_removal_date():
  assert deprecations.REMOVAL == "2027-06-01"
