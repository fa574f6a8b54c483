"""Headless Chromium driven over the DevTools protocol, for the site tests.

Why not Selenium or Playwright: both download a browser build of their own;
Debian's ``chromium`` package and the DevTools protocol (a WebSocket of JSON
messages, here through ``websocket-client``) are all the site test needs:
open a page, run JavaScript in it, click, and collect console errors and
uncaught exceptions.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import websocket


def chromium_path() -> str | None:
  for name in ("chromium", "chromium-browser", "google-chrome"):
    found = shutil.which(name)
    if found:
      return found
  return None


class Browser:
  """One headless Chromium process and one page (tab) of it."""

  def __init__(self, executable: str, timeout: float = 180.0):
    self.timeout = timeout
    self._profile = tempfile.mkdtemp(prefix="pz-docs-chromium-")
    self._process = subprocess.Popen(
        [executable, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
         "--remote-debugging-port=0", "--remote-allow-origins=*",
         f"--user-data-dir={self._profile}", "--window-size=1280,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    atexit.register(self._stop_process)  # Even if the caller never reaches close().
    port = self._wait_for_port()
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
    page = next(t for t in targets if t["type"] == "page")
    self._ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout)
    self._next_id = 0
    self.events: list[dict[str, Any]] = []
    for domain in ("Page", "Runtime", "Log"):
      self.call(f"{domain}.enable")

  def _wait_for_port(self) -> int:
    """The DevTools port, from the file Chromium writes once it listens."""
    port_file = os.path.join(self._profile, "DevToolsActivePort")
    deadline = time.monotonic() + self.timeout
    while time.monotonic() < deadline:
      if self._process.poll() is not None:
        raise RuntimeError(f"chromium exited with status {self._process.returncode}")
      try:
        with open(port_file) as f:
          first = f.readline().strip()
        if first:
          return int(first)
      except (FileNotFoundError, ValueError):
        pass
      time.sleep(0.05)  # Polling for a file another process writes.
    raise TimeoutError("chromium did not open its DevTools port")

  def call(self, method: str, **params: Any) -> dict[str, Any]:
    """Sends one command and returns its result; events seen meanwhile are kept."""
    self._next_id += 1
    ident = self._next_id
    self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
    while True:
      message = json.loads(self._ws.recv())
      if message.get("id") == ident:
        if "error" in message:
          raise RuntimeError(f"{method}: {message['error']}")
        return message.get("result", {})
      if "method" in message:
        self.events.append(message)

  def _wait_event(self, method: str) -> dict[str, Any]:
    for i, event in enumerate(self.events):
      if event["method"] == method:
        return self.events.pop(i)
    while True:
      message = json.loads(self._ws.recv())
      if message.get("method") == method:
        return message
      if "method" in message:
        self.events.append(message)

  def open(self, url: str) -> None:
    """Navigates to ``url`` and waits for its load event."""
    self.events.clear()
    self.call("Page.navigate", url=url)
    self._wait_event("Page.loadEventFired")

  def evaluate(self, expression: str) -> Any:
    """The value of a JavaScript expression in the page (promises awaited)."""
    result = self.call(
        "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
    )
    if "exceptionDetails" in result:
      raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
    return result["result"].get("value")

  def click(self, target: dict[str, Any]) -> None:
    """Clicks at ``target``'s ``x`` and ``y`` as a person does: a mouse
    press and release there (not a synthetic ``click()`` in JavaScript)."""
    for kind in ("mousePressed", "mouseReleased"):
      self.call("Input.dispatchMouseEvent", type=kind, x=target["x"], y=target["y"],
                button="left", clickCount=1)

  def wait_for(self, expression: str, what: str) -> Any:
    """Evaluates ``expression`` until it is truthy (the page's scripts run
    asynchronously); fails after the browser's timeout."""
    deadline = time.monotonic() + self.timeout
    while time.monotonic() < deadline:
      value = self.evaluate(expression)
      if value:
        return value
      time.sleep(0.05)  # Polling a condition in the page.
    raise TimeoutError(f"timed out waiting for {what}")

  def errors(self) -> list[str]:
    """Console errors and uncaught exceptions since the last `open`."""
    self.call("Runtime.evaluate", expression="0")  # Drains pending events.
    found = []
    for event in self.events:
      params = event.get("params", {})
      if event["method"] == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        found.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
      elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") == "error":
        found.append("console.error: " + " ".join(
            str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
      elif event["method"] == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        found.append(f"log: {entry.get('text')} ({entry.get('url', '')})")
    return found

  def screenshot(self, path: str) -> None:
    import base64

    data = self.call("Page.captureScreenshot", format="png")["data"]
    with open(path, "wb") as f:
      f.write(base64.b64decode(data))

  def _stop_process(self) -> None:
    if self._process.poll() is None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
    shutil.rmtree(self._profile, ignore_errors=True)

  def close(self) -> None:
    try:
      self._ws.close()
    finally:
      self._stop_process()
