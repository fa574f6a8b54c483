"""Step directory names, read as Orbax reads them, with pz_persist's rules."""

from __future__ import annotations

import pytest

from pz_persist.storage import steps


@pytest.mark.parametrize(
    "name, expected",
    [
        ("100", (100, True)),
        ("step_100", (100, True)),
        ("my_run_0042", (42, True)),
        ("100.orbax-checkpoint-tmp-1700000000", (100, False)),
        ("step_7.orbax-checkpoint-tmp", (7, False)),
        # Not steps: pz_persist's hidden save families, other names, and
        # names whose "digits" int() refuses (no crash in `pz-persist ls`).
        (".ckpt.pz_persist-new-12.orbax-checkpoint-tmp", None),
        ("._5", None),
        ("params", None),
        ("_5", None),
        ("step_", None),
        ("\u00b2", None),
        ("5\u00b2", None),
        ("abc123.orbax-checkpoint-tmp-1", None),
    ],
)
def test_parse_step_name(name, expected):
  assert steps.parse_step_name(name) == expected
