"""A tiny counting HTTP reverse proxy, to see where a remote save's requests go.

Why: request counts, not only seconds, are what an object store bills and
what its latency multiplies. Clients (TensorStore, gcsfs, s3fs) are pointed
at the proxy (``TENSORSTORE_GCS_HTTP_URL``, ``STORAGE_EMULATOR_HOST``,
``AWS_ENDPOINT_URL``), which forwards every request unchanged to the emulator
and counts it by method and by a short class of its path: what the request
does (``upload``, ``read``, ``metadata``, ``list``, ``copy``, ``delete``,
``multipart``...) and the object's name with random parts masked
(``gen-*/penzai/d/*``), so a report says which requests a library adds.

The proxy runs as threads of the benchmark's parent process; workers reset
and read the counters over HTTP (``/__counter__/reset``,
``/__counter__/counts``), just around the measured operation.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import json
import re
import sys
import threading
import urllib.parse
import urllib.request

CONTROL = "/__counter__/"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-connection", "content-length"}


def path_class(method: str, target: str, headers) -> tuple[str, str]:
  """(what the request does, the object name with random parts masked)."""
  parsed = urllib.parse.urlsplit(target)
  query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
  path = urllib.parse.unquote(parsed.path)
  if path.startswith(("/storage/v1/", "/upload/storage/v1/", "/download/storage/v1/",
                      "/batch/storage/v1")):
    return _gcs_class(method, path, query)
  return _s3_class(method, path, query, headers)


def _gcs_class(method: str, path: str, query: dict) -> tuple[str, str]:
  if path.startswith("/batch/"):
    return "batch", ""
  if path.startswith("/upload/"):
    kind = "upload (resumable)" if query.get("uploadType") == ["resumable"] else "upload"
    return kind, mask(query.get("name", [""])[0])
  match = re.match(r"/(?:download/)?storage/v1/b/[^/]+/o(?:/(.*))?$", path)
  if not match:
    return "bucket", ""
  name = match.group(1)
  if name is None:
    return ("list" if method == "GET" else "upload"), mask(query.get("prefix", [""])[0])
  for operation, kind in (("rewriteTo", "copy"), ("copyTo", "copy"), ("compose", "compose"),
                          ("moveTo", "move")):
    if f"/{operation}/" in name or name.endswith(f"/{operation}"):
      return kind, mask(name.split(f"/{operation}")[0])
  if method == "DELETE":
    return "delete", mask(name)
  if method == "GET":
    return ("read" if query.get("alt") == ["media"] else "metadata"), mask(name)
  return method.lower(), mask(name)


def _s3_class(method: str, path: str, query: dict, headers) -> tuple[str, str]:
  name = path.lstrip("/").split("/", 1)[1] if "/" in path.lstrip("/") else ""
  if "uploads" in query or "uploadId" in query:
    return "multipart", mask(name)
  if method == "POST" and "delete" in query:
    return "delete (bulk)", ""
  if method == "GET" and not name:
    return "list", mask(query.get("prefix", [""])[0])
  if method == "PUT":
    return ("copy" if headers.get("x-amz-copy-source") else "upload"), mask(name)
  kind = {"GET": "read", "HEAD": "metadata", "DELETE": "delete"}.get(method, method.lower())
  return kind, mask(name)


def mask(name: str) -> str:
  """``<run>/ck/gen-0123.../d/9f8e...`` -> ``ck/gen-*/d/*``: hex and digit
  runs masked, the benchmark's random run prefix dropped."""
  text = re.sub(r"[0-9a-f]{8,}", "*", name)
  text = re.sub(r"\d+", "#", text)
  return text.removeprefix("*/")


class Counter:
  """Request counts by (method, kind) and by (method, kind, name class)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.reset()

  def reset(self) -> None:
    with self._lock:
      self.by_kind: collections.Counter = collections.Counter()
      self.by_name: collections.Counter = collections.Counter()
      self.bytes_in = self.bytes_out = 0

  def add(self, method: str, kind: str, name: str, sent: int, received: int) -> None:
    with self._lock:
      self.by_kind[f"{method} {kind}"] += 1
      self.by_name[f"{method} {kind} {name}".rstrip()] += 1
      self.bytes_in += sent
      self.bytes_out += received

  def snapshot(self) -> dict:
    with self._lock:
      return {"total": sum(self.by_kind.values()), "by_kind": dict(self.by_kind),
              "by_name": dict(self.by_name), "bytes_up": self.bytes_in,
              "bytes_down": self.bytes_out}


def start(upstream: str) -> tuple[str, Counter, object]:
  """Starts a proxy in front of ``upstream`` (``http://host:port``).

  Returns:
    (the proxy's URL, its `Counter`, a function stopping it).
  """
  target = urllib.parse.urlsplit(upstream)
  counter = Counter()
  local = threading.local()

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # pylint: disable=arguments-differ
      pass

    def _body(self) -> bytes:
      if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
          size = int(self.rfile.readline().split(b";")[0].strip(), 16)
          if size == 0:
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
              pass
            return b"".join(chunks)
          chunks.append(self.rfile.read(size))
          self.rfile.readline()
      length = int(self.headers.get("Content-Length") or 0)
      return self.rfile.read(length) if length else b""

    def _control(self) -> None:
      if self.path.endswith("reset"):
        counter.reset()
        data = b"{}"
      else:
        data = json.dumps(counter.snapshot()).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _forward(self) -> None:
      if self.path.startswith(CONTROL):
        self._control()
        return
      body = self._body()
      headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
      if body or self.command in ("POST", "PUT", "PATCH"):
        headers["Content-Length"] = str(len(body))
      for attempt in (0, 1):
        connection = getattr(local, "connection", None)
        if connection is None:
          connection = local.connection = http.client.HTTPConnection(
              target.hostname, target.port, timeout=300)
        try:
          connection.request(self.command, self.path, body=body, headers=headers)
          response = connection.getresponse()
          data = response.read()
          break
        except (http.client.HTTPException, OSError):
          connection.close()
          local.connection = None
          if attempt:
            raise
      kind, name = path_class(self.command, self.path, self.headers)
      counter.add(self.command, kind, name, len(body), len(data))
      self.send_response(response.status, response.reason)
      for key, value in response.getheaders():
        if key.lower() in _HOP_BY_HOP and not (
            self.command == "HEAD" and key.lower() == "content-length"):
          continue
        if key.lower() == "location":  # Resumable uploads: stay behind the proxy.
          value = value.replace(upstream, proxy_url)
        self.send_header(key, value)
      if self.command != "HEAD":  # A HEAD's length is the object's (kept above).
        self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      if self.command != "HEAD":
        try:
          self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
          # The client gave up on this response (a cancelled read, a process
          # exiting): the request was made and counted; nothing to answer.
          self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

  class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
      if not isinstance(sys.exc_info()[1], ConnectionError):  # A client hanging up is fine.
        super().handle_error(request, client_address)

  server = Server(("127.0.0.1", 0), Handler)
  proxy_url = f"http://127.0.0.1:{server.server_address[1]}"
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()

  def stop():
    server.shutdown()
    server.server_close()

  return proxy_url, counter, stop


def reset(proxy_url: str) -> None:
  """Zeroes the counters of the proxy at ``proxy_url`` (from a worker)."""
  urllib.request.urlopen(proxy_url + CONTROL + "reset", timeout=10).close()


def counts(proxy_url: str) -> dict:
  """The counters of the proxy at ``proxy_url`` (from a worker)."""
  with urllib.request.urlopen(proxy_url + CONTROL + "counts", timeout=10) as response:
    return json.loads(response.read())
