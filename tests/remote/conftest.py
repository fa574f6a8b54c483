"""Fixtures of the remote tests: emulators started once per session.

``store`` is parametrized over ``gs`` and ``s3``; ``remote`` gives each test
a fresh, unique prefix on it (``gs://pz-test/<random>``). A server that
cannot start skips its tests with the reason; everything else is a failure.
Servers stop when the test process exits. ``tests/hostile/conftest.py``
imports these fixtures for the hostile remote tests.
"""

from __future__ import annotations

import atexit
import uuid

import pytest

from remote import emulators

_started: dict[str, emulators.Emulator | str] = {}


def _emulator(scheme: str) -> emulators.Emulator:
  if scheme not in _started:
    try:
      _started[scheme] = emulators.STARTERS[scheme]()
    except Exception as e:  # pylint: disable=broad-exception-caught
      _started[scheme] = f"the {scheme} emulator did not start: {type(e).__name__}: {e}"
  found = _started[scheme]
  if isinstance(found, emulators.Emulator) and not getattr(found, "_atexit", False):
    atexit.register(found.stop)  # Also when only tests/hostile imported us.
    found._atexit = True  # pylint: disable=protected-access
  if isinstance(found, str):
    pytest.skip(found)
  emulators.apply_env(found.env)
  return found


@pytest.fixture(params=["gs", "s3"])
def store(request) -> emulators.Emulator:
  """A running emulator, gs then s3."""
  return _emulator(request.param)


@pytest.fixture
def gcs() -> emulators.Emulator:
  return _emulator("gs")


@pytest.fixture
def s3() -> emulators.Emulator:
  return _emulator("s3")


@pytest.fixture
def remote(store) -> str:
  """A unique, empty prefix on the emulator of ``store``."""
  return f"{store.root()}/{uuid.uuid4().hex[:12]}"
