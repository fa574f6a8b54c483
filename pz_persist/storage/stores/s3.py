"""``s3://``: Amazon S3 and compatible stores (MinIO, R2, ...), through ``s3fs``."""

from __future__ import annotations

from typing import Any

from etils import epath

from pz_persist.storage.stores import base
from pz_persist.storage.stores import objects
from pz_persist.storage.stores import s3_kvstore


class S3Store(objects.FsspecStore):
  """Conditional create: ``If-None-Match: *``."""

  scheme = "s3"
  package = "s3fs"
  extra = "s3"

  def prepare(self, path: epath.PathLike) -> epath.Path:
    """Also teaches Orbax ``s3://`` (`s3_kvstore.enable_orbax_s3`), which it
    refuses for arrays and cannot publish by default: handing pz_persist an
    ``s3://`` path is the user's opt-in, and no working behaviour changes."""
    path = self.normalise(path)
    s3_kvstore.enable_orbax_s3()
    return path

  def object_info(self, raw: dict[str, Any]) -> base.ObjectInfo:
    """The ETag (plus version id where the bucket keeps versions) as the
    generation; the ETag of a single-part upload is its MD5."""
    etag = str(raw.get("ETag", raw.get("etag", ""))).strip('"')
    checksums = {}
    if etag and "-" not in etag:  # A multipart ETag is not an MD5.
      checksums["md5"] = bytes.fromhex(etag)
    return base.ObjectInfo(
        int(raw.get("size", 0)), f"{etag}:{raw.get('VersionId') or ''}", checksums
    )

