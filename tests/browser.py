"""Headless Chromium driven over the DevTools protocol: a small client for the dashboard's browser tests.

Debian's `chromium` (the Makefile's test set-up installs it when missing, `make browser`); the protocol is spoken
over the WebSocket that Chromium opens on 127.0.0.1 (aiohttp, already a dependency of Faust's web server). It
collects what a person would see as errors: console errors, uncaught exceptions, failed loads."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_path() -> str | None:
    explicit = os.environ.get("GPUPOOL_CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    def __init__(self, width: int = 1440, height: int = 1000):
        self.width, self.height = width, height
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._events: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # ---------------------------------------------------------------- the process and the socket

    def __enter__(self) -> "Browser":
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("no chromium: `make browser` (apt-get install chromium) or set GPUPOOL_CHROMIUM")
        self._profile = tempfile.mkdtemp(prefix="gpupool-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        req = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as resp:
            target = json.loads(resp.read())
        self._thread.start()
        self._call(self._connect(target["webSocketDebuggerUrl"]))
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if getattr(self, "_ws", None) is not None:
                self._call(self._close())
        except Exception:  # noqa: BLE001 - closing a dead browser
            pass
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        shutil.rmtree(getattr(self, "_profile", ""), ignore_errors=True)

    def _call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self, url: str) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())

    async def _close(self) -> None:
        self._reader.cancel()
        await self._ws.close()
        await self._session.close()

    async def _read(self) -> None:
        async for msg in self._ws:
            doc = json.loads(msg.data)
            if "id" in doc:
                fut = self._pending.pop(doc["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(doc)
                continue
            self._on_event(doc)

    def _on_event(self, doc: dict) -> None:
        method, p = doc.get("method"), doc.get("params", {})
        self._events.append(doc)
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            e = p["entry"]
            # a 4xx the page asked for on purpose (a refused API call) is the page's to show, not an error here
            if not (e.get("source") == "network" and self.expected_status(e.get("text", ""))):
                self.errors.append(f"log: {e.get('text')} {e.get('url', '')}".strip())

    expected = (404,)

    def expected_status(self, text: str) -> bool:
        return any(f"status of {code}" in text for code in self.expected)

    async def _send(self, method: str, params: dict) -> dict:
        i = next(self._ids)
        fut = self._loop.create_future()
        self._pending[i] = fut
        await self._ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        doc = await asyncio.wait_for(fut, 60)
        if "error" in doc:
            raise RuntimeError(f"{method}: {doc['error']}")
        return doc.get("result", {})

    def send(self, method: str, **params) -> dict:
        return self._call(self._send(method, params))

    # ---------------------------------------------------------------- what a test does

    def goto(self, url: str) -> None:
        self._events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def eval(self, expression: str):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.eval(expression)
            except RuntimeError:
                last = None
            if last:
                return last
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting in the browser for {expression}; errors: {self.errors}")

    def text(self, selector: str = "body") -> str:
        return self.eval(f"(document.querySelector({json.dumps(selector)}) || {{}}).innerText || ''")

    def screenshot(self, path: Path) -> Path:
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        h = min(int(size["height"]) + 20, 4000)
        r = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                      clip={"x": 0, "y": 0, "width": self.width, "height": h, "scale": 1})
        path.write_bytes(base64.b64decode(r["data"]))
        return path

    # ---------------------------------------------------------------- the dashboard

    def sign_in(self, base: str, name: str, token: str, page: str = "cluster") -> None:
        self.goto("about:blank")  # a fresh load of the dashboard, signed out
        self.goto(f"{base}/ui/")
        self.eval("sessionStorage.clear(); true")
        self.goto("about:blank")
        self.goto(f"{base}/ui/#/{page}")
        self.wait_for("!document.getElementById('signin').hidden")
        self.eval(f"document.getElementById('signin-name').value = {json.dumps(name)};"
                  f"document.getElementById('signin-token').value = {json.dumps(token)};"
                  "document.getElementById('signin-submit').click(); true")
        self.wait_for("document.getElementById('page').dataset.ready === '1'", 120)

    def open(self, base: str, route: str, timeout: float = 120.0) -> str:
        """Go to a page of the dashboard and wait until it has drawn (its queries can be slow on a busy machine)."""
        self.eval("(() => { const want = " + json.dumps("#/" + route) + "; document.getElementById('page').dataset.ready"
                  " = ''; if (location.hash === want) route(); else location.hash = want; return true; })()")
        self.wait_for("document.getElementById('page').dataset.ready === '1'", timeout)
        return self.text("#page")


def screenshots(b: Browser, stack, out: Path) -> list[Path]:
    """Every page of the dashboard as the admin operator sees it (the service page and a job's as the tenant)."""
    out.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{stack.web_port}"
    shots = []
    b.sign_in(base, "admin", stack.client().creds.token)
    for route in ("cluster", "utilization", "queue", "tenants", "jobs"):
        b.open(base, route)
        time.sleep(0.5)
        shots.append(b.screenshot(out / f"dashboard-{route}.png"))
    b.sign_in(base, "alice", stack.client("alice").creds.token, "jobs")
    b.open(base, "job/" + "acme%2Ftrain-llm")
    time.sleep(0.5)
    shots.append(b.screenshot(out / "dashboard-job.png"))
    b.open(base, "service/" + "acme%2Fchat")
    time.sleep(0.5)
    shots.append(b.screenshot(out / "dashboard-service.png"))
    b.goto(f"{base}/ui/")
    b.eval("sessionStorage.clear(); location.reload(); true")
    time.sleep(1.0)
    shots.append(b.screenshot(out / "dashboard-signin.png"))
    return shots
