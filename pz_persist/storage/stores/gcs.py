"""``gs://``: Google Cloud Storage, through ``gcsfs``."""

from __future__ import annotations

import base64
from typing import Any

from pz_persist.storage.stores import base
from pz_persist.storage.stores import objects


class GcsStore(objects.FsspecStore):
  """Conditional create: ``ifGenerationMatch=0``."""

  scheme = "gs"
  package = "gcsfs"
  extra = "gcs"

  def object_info(self, raw: dict[str, Any]) -> base.ObjectInfo:
    """The object's generation, and its CRC32C and MD5 (base64 in listings)."""
    checksums = {}
    for name, field in (("crc32c", "crc32c"), ("md5", "md5Hash")):
      if raw.get(field):
        checksums[name] = base64.b64decode(raw[field])
    return base.ObjectInfo(int(raw.get("size", 0)), str(raw.get("generation", "")), checksums)
