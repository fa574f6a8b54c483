"""The library version (the manifest format has its own, FORMAT_VERSION), and
the commands that install or upgrade it, for messages that tell a user what
to run."""

__version__ = "0.7.0"

CLONE = "in a clone of the repository"
"""How `install_command` names the other way of installing pz_persist."""


def install_command(extra: str | None = None, *, upgrade: bool = False) -> str:
  """What to run to install pz_persist (with ``extra``), or to upgrade it.

  Why: users install pz_persist from a package index (``pip install
  pz-persist``) or, as the README says, from a clone of its repository (``pip
  install -e .``), and a message that names only the first sends the second
  to a package index, for a release older than their clone or none at all.
  Every message that tells a user to install or upgrade pz_persist says it
  through this function, so each names both.

  Example:
    >>> from pz_persist import version
    >>> version.install_command("gcs")
    "pip install 'pz-persist[gcs]' (in a clone of the repository: pip install -e '.[gcs]')"
    >>> version.install_command(upgrade=True)
    'pip install -U pz-persist (in a clone of the repository: git pull, then pip install -e .)'
  """
  if upgrade:
    if extra is not None:
      raise ValueError("install_command: an upgrade keeps the extras installed; give no extra")
    return f"pip install -U pz-persist ({CLONE}: git pull, then pip install -e .)"
  if extra is None:
    return f"pip install pz-persist ({CLONE}: pip install -e .)"
  return f"pip install 'pz-persist[{extra}]' ({CLONE}: pip install -e '.[{extra}]')"
