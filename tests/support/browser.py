"""Headless Chromium for tests, offline, driven over the DevTools protocol.

    with Browser(chromium_path) as browser:           # the `chromium` fixture installs it if missing
        page = browser.load("/tmp/report.html", screenshot="/tmp/report.png")
        page.errors    # console.error / console.assert calls, uncaught exceptions, failed loads
        page.plots     # one dict per plotly div: rendered, visible, title, main_svgs, traces, points

The browser's network is blocked (every request, loopback included, goes to a proxy that refuses
connections), so a page that needs anything beyond its own file logs a failed load and, if that was
a script, its plots stay unrendered. The protocol runs over aiohttp's websocket client (aiohttp is
already a dependency): no new packages for the tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

INSTALL_SECONDS = 900  # installing Chromium and its libraries with the system's package manager
START_SECONDS = 60.0  # Chromium's start, to its DevTools port
EXIT_SECONDS = 10  # Chromium's exit once terminated
LOAD_SECONDS = 90.0  # one page's load, its script and its plots
PORT_LOOK_SECONDS = 0.1  # how often the start looks for Chromium's DevTools port file
PLOTS_LOOK_SECONDS = 0.25  # how often a load asks the page whether its plots have rendered

DEBIAN_PACKAGE = "chromium"
# The discard port: nothing listens, so every proxied request fails at once. --no-sandbox: CI and
# dev containers run as root, where Chromium refuses to start with its sandbox.
BLOCKED_PROXY = "127.0.0.1:9"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--disable-component-update", "--hide-scrollbars", "--window-size=1200,900",
         f"--proxy-server={BLOCKED_PROXY}", "--proxy-bypass-list=<-loopback>", "--remote-debugging-port=0"]

# Every div plotly's to_html writes has class plotly-graph-div; Plotly.newPlot adds js-plotly-plot.
PLOTS_JS = """Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => ({
  rendered: d.classList.contains('js-plotly-plot'),
  visible: d.offsetParent !== null,
  title: (d.querySelector('.gtitle') || {}).textContent || null,
  main_svgs: d.querySelectorAll('svg.main-svg').length,
  traces: d.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length,
  points: d.querySelectorAll('.scatterlayer .trace .point, .barlayer .trace .point').length,
}))"""


def install_chromium() -> str:
    """Chromium's path, installed with apt-get first when `chromium` is not on PATH; a failed
    install fails the test with apt's output (never a silent skip)."""
    found = shutil.which("chromium")
    if found:
        return found
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", DEBIAN_PACKAGE]):
        try:
            proc = subprocess.run(sudo + cmd, env=env, capture_output=True, text=True, timeout=INSTALL_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.fail(f"installing Chromium failed: {' '.join(sudo + cmd)}: {e}")
        if proc.returncode != 0:
            pytest.fail(f"installing Chromium failed: {' '.join(sudo + cmd)} exited {proc.returncode}\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.fail(f"apt-get installed {DEBIAN_PACKAGE} but `chromium` is not on PATH")
    return found


@pytest.fixture(scope="session")
def chromium() -> str:
    return install_chromium()


@dataclass(frozen=True)
class PageLoad:
    url: str
    errors: list[str]
    plots: list[dict]
    screenshot: Path | None


class Browser:
    """One headless Chromium process with its own profile; `load` opens one page at a time."""

    def __init__(self, chromium_path: str, *, start_timeout_seconds: float = START_SECONDS):
        self.path = chromium_path
        self.start_timeout_seconds = start_timeout_seconds
        self._profile = tempfile.TemporaryDirectory(prefix="miles-chromium-", ignore_cleanup_errors=True)
        self._log = open(os.path.join(self._profile.name, "chromium.log"), "w+b")
        self._proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> "Browser":
        self._proc = subprocess.Popen([self.path, *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.port = self._wait_for_port()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._stop()
        self._log.close()
        self._profile.cleanup()

    def _stop(self) -> None:
        """Stop the browser, then whatever of its helpers (zygote, renderers) outlived it: they
        share the session this class started, so killing that group reaches nothing else."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _wait_for_port(self) -> int:
        """Chromium writes the port it picked to DevToolsActivePort in the profile once it listens."""
        marker = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_seconds
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited {self._proc.returncode} at start:\n{self.log_tail()}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(PORT_LOOK_SECONDS)
        raise RuntimeError(f"chromium did not open its DevTools port in {self.start_timeout_seconds:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-chars:]

    def load(self, path: str | Path, *, screenshot: str | Path | None = None, script: str = "",
             timeout_seconds: float = LOAD_SECONDS, settle_seconds: float = 15.0) -> PageLoad:
        """Open `path` as a file:// URL in a fresh tab, wait for the load event, run `script` (e.g.
        click a tab), wait for every plotly div to render (at most `settle_seconds`), then read the
        plots and errors and take a full-page screenshot."""
        page = _Page(Path(path).resolve().as_uri(), Path(screenshot) if screenshot else None, script,
                     settle_seconds)
        return asyncio.run(asyncio.wait_for(self._in_new_tab(page), timeout_seconds))

    async def _in_new_tab(self, page: "_Page") -> PageLoad:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as resp:
                target = await resp.json(content_type=None)
            try:
                async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    return await page.drive(_Cdp(ws))
            finally:
                async with http.get(f"http://127.0.0.1:{self.port}/json/close/{target['id']}"):
                    pass


@dataclass(frozen=True)
class _Page:
    url: str
    screenshot: Path | None
    script: str
    settle_seconds: float

    async def drive(self, cdp: "_Cdp") -> PageLoad:
        for domain in ("Page", "Runtime", "Log"):
            await cdp.call(f"{domain}.enable")
        await cdp.call("Page.navigate", url=self.url)
        await cdp.wait_event("Page.loadEventFired")
        if self.script:
            await cdp.evaluate(self.script)
        plots = await cdp.evaluate(PLOTS_JS)
        deadline = time.monotonic() + self.settle_seconds
        while not all(p["rendered"] and p["main_svgs"] for p in plots) and time.monotonic() < deadline:
            await asyncio.sleep(PLOTS_LOOK_SECONDS)
            plots = await cdp.evaluate(PLOTS_JS)
        shot = await _screenshot(cdp, self.screenshot) if self.screenshot else None
        return PageLoad(self.url, cdp.errors(), plots, shot)


async def _screenshot(cdp: "_Cdp", path: Path) -> Path:
    size = (await cdp.call("Page.getLayoutMetrics"))["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = await cdp.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


class _Cdp:
    """A DevTools session on one page: `call` sends a command and returns its result; every event
    read meanwhile is kept, so none is lost between commands."""

    def __init__(self, ws):
        self.ws = ws
        self.events: list[dict] = []
        self._next_id = 0

    async def call(self, method: str, **params) -> dict:
        self._next_id += 1
        await self.ws.send_str(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            msg = await self._receive()
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method} failed: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def wait_event(self, method: str) -> dict:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(await self._receive())
        return next(e for e in self.events if e.get("method") == method)

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating {expression[:60]!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")  # absent for undefined

    async def _receive(self) -> dict:
        msg = await self.ws.receive()
        if msg.type.name != "TEXT":
            raise RuntimeError(f"DevTools connection ended: {msg.type.name} {msg.data!r}")
        return json.loads(msg.data)

    def errors(self) -> list[str]:
        return [text for e in self.events if (text := _error_text(e)) is not None]


def _error_text(event: dict) -> str | None:
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        details = params["exceptionDetails"]
        return "uncaught: " + (details.get("exception", {}).get("description") or details.get("text", ""))
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        return f"console.{params['type']}: " + " ".join(
            str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
    if method == "Log.entryAdded" and params["entry"].get("level") == "error":
        entry = params["entry"]
        return f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".rstrip()
    return None
