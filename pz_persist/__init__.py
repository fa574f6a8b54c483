"""pz_persist: save, inspect and load Penzai models, through Orbax."""

from pz_persist import errors
from pz_persist.allowlist import allow_modules
from pz_persist.checkpoint import inspect, load, save
from pz_persist.errors import PzPersistError
from pz_persist.orbax_v0 import PenzaiCheckpointHandler, PenzaiRestore, PenzaiSave
from pz_persist.orbax_v1 import PenzaiCheckpointableHandler
from pz_persist.registration import register_handlers
from pz_persist.version import __version__

register_handlers()
