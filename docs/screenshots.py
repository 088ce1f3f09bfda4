"""Screenshots of TensorBoard's dashboards for one run, taken by headless Chromium (Debian's
`chromium`) from a `tensorboard` served on 127.0.0.1 only. The pictures in docs/screenshots/ come
from here, not from a hand:

    python docs/screenshots.py                        # trains the docs' Fashion-MNIST run first
    python docs/screenshots.py --logdir runs/mine --out /tmp/shots

tests/test_tensorboard_browser.py drives the same browser (`take`) over a test run and checks what
each dashboard's page shows (its text and images, shadow DOM included).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# dashboard -> the data route that answers once TensorBoard has read the run's events for it
DASHBOARDS = {
    "images": "/data/plugin/images/tags",
    "pr_curves": "/data/plugin/pr_curves/tags",
    "custom_scalars": "/data/plugin/custom_scalars/layout",
    "text": "/data/plugin/text/tags",
}
WINDOW = (1400, 1000)  # pixels
DOCS_RUN = [
    "--dataset=fashion_mnist",
    "--train_steps=1000",
    "--steps_per_loop=50",
    "--eval_every=100",
    "--global_batch=128",
    "--seed=1",
    "--noexport",
]
STARTUP_SECONDS = 60
SETTLE_SECONDS = 2.0  # after the data shows, before the screenshot (charts animate in)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    raise SystemExit("no chromium on PATH: apt-get install chromium (Debian) to take screenshots")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return None


def start_tensorboard(logdir: str):
    """(process, base URL) of a tensorboard on 127.0.0.1 that answers."""
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
            "--reload_interval=1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    while _answer(base + "/data/runs") is None:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"tensorboard did not start on {base} in {STARTUP_SECONDS} s")
        time.sleep(0.5)
    return server, base


def _wait_for_data(base: str, route: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _answer(base + route):
            return True
        time.sleep(0.5)
    return False


# Every text node and loaded image of the page, shadow roots included (TensorBoard's dashboards are
# web components): what a reader of the page sees, as lines.
_PAGE_TEXT_JS = """(() => {
  const parts = [];
  const walk = (node) => {
    if (node.nodeType === Node.TEXT_NODE) { const t = node.textContent.trim(); if (t) parts.push(t); return; }
    if (node.nodeType !== Node.ELEMENT_NODE && node.nodeType !== Node.DOCUMENT_FRAGMENT_NODE) return;
    if (['STYLE', 'SCRIPT', 'NOSCRIPT'].includes(node.tagName)) return;
    if (node.tagName === 'IMG' && node.naturalWidth > 0)
      parts.push('<img ' + node.naturalWidth + 'x' + node.naturalHeight + ' ' + decodeURIComponent(node.src) + '>');
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  walk(document.documentElement);
  return parts.join('\\n');
})()"""


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page): open a URL, read the page's
    text, take a screenshot. Listens on 127.0.0.1 only."""

    def __init__(self):
        import websocket  # websocket-client, in the test extra

        port = _free_port()
        self._profile = tempfile.mkdtemp(prefix="chromium_profile_")
        self.process = subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
                f"--remote-debugging-port={port}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-allow-origins=*",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + STARTUP_SECONDS
        pages = None
        while not pages:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"chromium's DevTools did not answer on 127.0.0.1:{port}")
            time.sleep(0.3)
            pages = [p for p in (_answer(f"http://127.0.0.1:{port}/json/list") or []) if p.get("type") == "page"]
        self._socket = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self._id = 0
        self.call(
            "Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1], deviceScaleFactor=1, mobile=False
        )

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self._socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        """A fresh load (TensorBoard keeps a dashboard opened by a #fragment alive beside the next)."""
        self.call("Page.navigate", url="about:blank")
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.call("Runtime.evaluate", expression=_PAGE_TEXT_JS, returnByValue=True)["result"].get("value", "")

    def wait_for_text(self, needles, seconds: float = STARTUP_SECONDS) -> str:
        """The page's text once it holds every needle (or, after `seconds`, as it is)."""
        deadline = time.monotonic() + seconds
        text = self.text()
        while not all(needle in text for needle in needles) and time.monotonic() < deadline:
            time.sleep(0.5)
            text = self.text()
        return text

    def screenshot(self, path: str) -> None:
        time.sleep(SETTLE_SECONDS)  # charts animate in
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "_socket", None) is not None:
            self._socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self._profile, ignore_errors=True)


def take(logdir: str, out: str, needles=None) -> dict:
    """{dashboard: (PNG path, the page's text)}: each of DASHBOARDS opened in Chromium from a
    tensorboard on `logdir`, waiting (up to a minute) until its text holds every one of
    needles[dashboard] (default: TensorBoard has data for it)."""
    os.makedirs(out, exist_ok=True)
    server, base = start_tensorboard(logdir)
    browser = Browser()
    try:
        shots = {}
        for name, route in DASHBOARDS.items():
            if needles is None:
                _wait_for_data(base, route, STARTUP_SECONDS)
            browser.open(f"{base}/#{name}")
            text = browser.wait_for_text((needles or {}).get(name, ()), seconds=STARTUP_SECONDS)
            path = os.path.join(out, f"{name}.png")
            browser.screenshot(path)
            shots[name] = (path, text)
        return shots
    finally:
        browser.close()
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", help="a run's directory (default: train the docs' run in a temporary one)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "screenshots"), help="where the PNGs go")
    args = parser.parse_args()
    logdir = args.logdir
    if logdir is None:
        logdir = tempfile.mkdtemp(prefix="tensorboard_docs_")
        subprocess.run([sys.executable, os.path.join(REPO, "run.py"), f"--model_dir={logdir}", *DOCS_RUN], check=True)
    for name, (path, _) in take(logdir, args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
