"""The dashboard: a container's line until the job page shows it, next to
``docker logs -f``; the overview's first paint; the control process's memory
with five dashboards open.

Set-up: alice shares this machine in a ``gpumesh share`` process, bob is paired
with her (as in bench/dispatch.py); bob's ``gpumesh-control`` serves his
dashboard on loopback, and Debian's chromium (``/usr/bin/chromium``, through
Playwright) is signed in to it.

* **Line to page.** Each container runs bench/log_latency.py's script: it
  stamps every line with the kernel's clock (microseconds) before writing it.
  The job is submitted through the control API, the job page is opened, and a
  script the test adds to the page (before the page's own; it changes nothing)
  notes, in the animation frame after a line's element got its whole text, the
  page's wall clock. The browser runs on the same kernel, so the difference is
  the latency to the frame that draws the line. The baseline reads the same
  script's container, run by ``docker run -d``, with ``docker logs -f`` into a
  pipe (log_latency's reader). Paths take turns, ``--rounds`` containers each;
  lines stamped before the reader had the warm-up line are not counted.
* **First paint.** ``first-contentful-paint`` of the overview (``/``), signed in,
  ``--loads`` times, from the browser's own Paint Timing entry.
* **Memory.** Five signed-in overview pages (charts polling the GPU history,
  regions refreshing every 5 s) for ``--minutes``; the control process's RSS
  (``/proc/PID/status``) every 10 s. The history is a fixed ring, so RSS should
  level off.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, source_note
from _benchlib import summarize as summarize_
from dispatch import DEFAULT_IMAGE, PEER, Provider, docker_ready, local_provider, remove_containers
from log_latency import (
    BENCH_LABEL,
    DOCKER_LOGS,
    LINE,
    Runner,
    Sample,
    container_script,
    counted,
    parse_lines,
)

CHROMIUM = "/usr/bin/chromium"
PAGE = "dashboard job page"
PATHS = (PAGE, DOCKER_LOGS)

# Runs before the page's own script (Playwright adds it through the DevTools
# protocol, which the page's CSP does not govern): it only watches the log.
WATCH = """
(() => {
  const pattern = /^%s (\\d+|end) (\\d+|-) (\\d+|-) (\\d+|-) (\\d+|-)$/;
  window.__lines = [];
  const seen = new WeakSet();
  let queued = false;
  const scan = () => {
    queued = false;
    const now = performance.timeOrigin + performance.now();
    for (const el of document.querySelectorAll("#log .line")) {
      if (seen.has(el) || !pattern.test(el.textContent)) continue;
      seen.add(el);
      window.__lines.push([now / 1000, el.textContent]);
    }
  };
  new MutationObserver(() => {
    if (!queued) { queued = true; requestAnimationFrame(scan); }
  }).observe(document, { childList: true, subtree: true, characterData: true });
})();
"""


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("gpumesh", timeout=120)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(self._path))


def api(home: Path, method: str, path: str, body: object = None) -> Any:
    """One control API request on bob's unix socket."""
    conn = _Unix(home / "control.sock")
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    if response.status >= 300:
        raise SystemExit(f"{method} {path}: HTTP {response.status}: {raw.decode()[:300]}")
    return json.loads(raw)


@contextlib.contextmanager
def control(provider: Provider) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """bob's ``gpumesh-control`` on a free loopback port, until the block ends."""
    binary = str(Path(sys.executable).parent / "gpumesh-control")
    url = f"http://127.0.0.1:{free_port()}"
    env = dict(provider.env, GPUMESH_API_ADDR=url.removeprefix("http://"))
    proc = subprocess.Popen(
        [binary], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "OpenAPI" in line:
                break
        else:
            raise SystemExit(f"gpumesh-control did not start: {proc.communicate()}")
        yield proc, url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def sign_in(browser: Any, home: Path, **options: Any) -> Any:
    """A page of a new context, signed in with a one-time login URL."""
    context = browser.new_context(**options)
    context.add_init_script(WATCH % "gpumesh-bench")
    page = context.new_page()
    page.goto(api(home, "POST", "/api/v1/auth/login-codes")["url"])
    from playwright.sync_api import Error

    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(Error):  # the page reloads once signed in
            if page.evaluate("!document.getElementById('login') && !location.hash"):
                return page
        if time.monotonic() > deadline:
            raise SystemExit("the dashboard did not sign in")
        time.sleep(0.1)


def page_once(args: argparse.Namespace, provider: Provider, page: Any, url: str) -> Sample:
    lines = math.ceil(args.lines / args.rounds)
    script = container_script(lines, args.interval)
    body = {"peer": PEER, "image": args.image, "command": ["sh", "-c", script]}
    job = api(provider.bob_home, "POST", "/api/v1/jobs", body)
    page.goto(f"{url}/jobs/{job['job_id']}")
    deadline = time.monotonic() + 120 + lines * args.interval * 3
    while True:
        seen = page.evaluate("window.__lines")
        if seen and seen[-1][1].startswith("gpumesh-bench end"):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{PAGE}: the job's end line never showed ({len(seen)} lines)")
        time.sleep(0.2)
    received = [(float(t), text.encode()) for t, text in seen if LINE.match(text)]
    return counted(parse_lines(PAGE, received, lines, ""))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for process {pid}")


def measure(args: argparse.Namespace, tmp: Path) -> None:
    from playwright.sync_api import sync_playwright

    docker_ready(args.image)
    label = f"{BENCH_LABEL}={secrets.token_hex(6)}"
    samples: dict[str, list[Sample]] = {path: [] for path in PATHS}
    paints: list[float] = []
    memory: list[tuple[float, int]] = []
    try:
        with (
            local_provider(tmp) as provider,
            control(provider) as (proc, _api_url),
            sync_playwright() as playwright,
        ):
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            runner = Runner(args, provider, label)
            page = sign_in(browser, provider.bob_home)
            # The home's own <random>.localhost name: the session cookie counts there.
            site = page.evaluate("location.origin")
            print(
                f"Line to page: {args.rounds} round(s) of {', '.join(PATHS)}, "
                f"{math.ceil(args.lines / args.rounds)} lines each, {args.interval:g} s apart...",
                flush=True,
            )
            for index in range(args.rounds):
                order = PATHS if index % 2 == 0 else PATHS[::-1]
                for path in order:
                    if path == PAGE:
                        samples[path].append(page_once(args, provider, page, site))
                    else:
                        samples[path].append(runner.once(path, math.ceil(args.lines / args.rounds)))
            print(f"First paint of the overview, {args.loads} loads...", flush=True)
            for _ in range(args.loads):
                page.goto(site + "/")
                paints.append(
                    page.evaluate(
                        "new Promise((done) => { const look = () => { const e = performance"
                        ".getEntriesByName('first-contentful-paint')[0]; e ? done(e.startTime) "
                        ": setTimeout(look, 20); }; look(); })"
                    )
                    / 1e3
                )
            page.context.close()
            print(f"Memory: 5 dashboards open for {args.minutes:g} min...", flush=True)
            pages = [sign_in(browser, provider.bob_home) for _ in range(5)]
            for each in pages:
                each.goto(site + "/")
            start = time.monotonic()
            while True:
                memory.append((time.monotonic() - start, rss_kib(proc.pid)))
                if time.monotonic() - start >= args.minutes * 60:
                    break
                time.sleep(10)
            browser.close()
    finally:
        remove_containers(label)
    report(args, samples, paints, memory)


def report(
    args: argparse.Namespace,
    samples: dict[str, list[Sample]],
    paints: list[float],
    memory: list[tuple[float, int]],
) -> None:
    merged = {p: [x for s in samples[p] for x in s.latencies] for p in PATHS}
    for path, values in merged.items():
        if not values:
            raise SystemExit(f"{path}: no line was received live")
    base = summarize_(merged[DOCKER_LOGS])
    rows = []
    for path in PATHS:
        s = summarize_(merged[path])
        rows.append(
            [path, f"{s.p50 * 1e3:.2f}", f"{s.p90 * 1e3:.2f}", f"{s.high * 1e3:.2f}", str(s.n),
             f"{s.p50 / base.p50:.2f}x"]
        )  # fmt: skip
    print(f"\nContainer line -> visible; {args.rounds} round(s), lines {args.interval:g} s apart")
    print_rows(["", "p50 ms", "p90 ms", "max ms", "lines", f"p50 vs {DOCKER_LOGS}"], rows)
    replayed = {p: sum(s.replayed for s in samples[p]) for p in PATHS}
    if any(replayed.values()):
        print(f"  not counted (stamped before the reader was live): {replayed}")
    paint = summarize_(paints)
    print(
        f"\nOverview first contentful paint, {paint.n} loads: p50 {paint.p50 * 1e3:.0f} ms, "
        f"p90 {paint.p90 * 1e3:.0f} ms"
    )
    first, last = memory[0][1], memory[-1][1]
    peak = max(kib for _, kib in memory)
    print(
        f"\ngpumesh-control RSS with 5 dashboards open, {memory[-1][0] / 60:.1f} min: "
        f"{first / 1024:.1f} MiB at start, {last / 1024:.1f} MiB at the end, peak "
        f"{peak / 1024:.1f} MiB ({len(memory)} readings)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Dashboard: container line to the job page vs docker logs -f, the "
        "overview's first paint, and the control process's memory with 5 dashboards open.",
    )
    parser.add_argument("--lines", type=int, default=40, help="counted lines per path (40)")
    parser.add_argument("--rounds", type=int, default=2, help="containers per path (2)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between lines")
    parser.add_argument("--loads", type=int, default=10, help="overview loads timed (10)")
    parser.add_argument("--minutes", type=float, default=10, help="dashboards open (10 min)")
    parser.add_argument("--quick", action="store_true", help="10 lines, 1 round, 3 loads, 0.5 min")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help=f"busybox image ({DEFAULT_IMAGE})")
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.rounds, args.loads, args.minutes = 10, 1, 3, 0.5
    if args.rounds < 1 or args.lines < args.rounds * 2 or args.loads < 1:
        parser.error("--rounds and --loads must be at least 1, --lines at least 2 per round")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if not os.path.exists(CHROMIUM):
        raise SystemExit(f"no {CHROMIUM}: scripts/ensure-browser.sh installs it")
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            measure(args, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
