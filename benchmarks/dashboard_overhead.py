"""What keeping /dashboard open costs the server: output throughput of one fixed load with and without the
page open in a headless browser (Debian's chromium, driven by selenium) on the same machine.

Trials alternate A (no page) and B (page open), so bandwidth and frequency swings of the machine fall on
both; the figure is the ratio of the medians. With --screenshot PATH, the page is also saved as a PNG
while the load runs (docs/dashboard.png).

    python benchmarks/dashboard_overhead.py [--model M] [--rounds 4] [--screenshot docs/dashboard.png]

With --browser-cpu, instead: the CPU time the browser's process tree spends showing the page for 30 s
while 4 chats run back to back, and the round trip of /dashboard/stats meanwhile (needs psutil).

With --server-cpu, instead: the CPU time the server process spends answering the page's poll. After a
load has filled the timeline, the server's CPU time is read over --seconds with no requests, then over
--seconds with /dashboard/stats?since=... asked --poll-hz times a second (the page asks once a second);
the difference per answer is the engine time one poll can take (the answer is Python holding the GIL, so
this bounds what it takes from the engine thread), and its share at one poll a second is the cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.server_utils import ServerProcess  # noqa: E402


async def load(url: str, requests: int, concurrency: int, max_tokens: int) -> float:
    """Output tokens per second of `requests` completions, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i):
            nonlocal tokens
            async with sem:
                r = await client.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Write a short story about the number {i}."}],
                    "max_tokens": max_tokens, "ignore_eos": True, "seed": i})
                tokens += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return tokens / (time.perf_counter() - start)


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def browser_cpu(url: str, seconds: float = 30.0) -> None:
    import psutil

    stop = threading.Event()

    def chats():
        while not stop.is_set():
            httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32})

    workers = [threading.Thread(target=chats) for _ in range(4)]
    for w in workers:
        w.start()
    page = None
    try:
        time.sleep(20)
        page = browser()
        page.get(url + "/dashboard")
        time.sleep(5)
        tree = psutil.Process(page.service.process.pid)

        def cpu_seconds():
            total = 0.0
            for p in [tree] + tree.children(recursive=True):
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            return total

        c0, t0 = cpu_seconds(), time.time()
        time.sleep(seconds)
        share = (cpu_seconds() - c0) / (time.time() - t0)
        print(f"browser showing the page: {share * 100:.2f}% of one CPU over {seconds:.0f} s under load")
        trips = []
        for _ in range(20):
            start = time.perf_counter()
            httpx.get(url + f"/dashboard/stats?since={int(time.time()) - 3}", timeout=30)
            trips.append(time.perf_counter() - start)
        full = httpx.get(url + "/dashboard/stats", timeout=30)
        print(f"/dashboard/stats?since round trip median {statistics.median(trips) * 1000:.1f} ms; "
              f"a fresh page's five minutes: {len(full.content)} bytes")
    finally:
        stop.set()
        for w in workers:
            w.join()
        if page is not None:
            page.quit()


def server_cpu(server, seconds: float, poll_hz: float) -> None:
    import psutil

    proc = psutil.Process(server.proc.pid)

    def cpu():
        t = proc.cpu_times()
        return t.user + t.system

    asyncio.run(load(server.url, 32, 8, 32))  # the timeline gets points to send
    time.sleep(2)
    c0, t0 = cpu(), time.time()
    time.sleep(seconds)
    idle = (cpu() - c0) / (time.time() - t0)
    calls, sizes = 0, []
    c0, t0 = cpu(), time.time()
    with httpx.Client(timeout=30) as client:
        while time.time() - t0 < seconds:
            r = client.get(server.url + f"/dashboard/stats?since={int(time.time()) - 3}")
            sizes.append(len(r.content))
            calls += 1
            time.sleep(max(0.0, t0 + calls / poll_hz - time.time()))
        polled = (cpu() - c0) / (time.time() - t0)
    per_call = (polled - idle) * (time.time() - t0) / calls
    print(f"server CPU: idle {idle * 100:.2f}% of one CPU, polled {poll_hz:g}/s {polled * 100:.2f}%; "
          f"{per_call * 1000:.2f} ms per answer ({statistics.median(sizes)} bytes); at the page's one poll a "
          f"second: {per_call * 100:.3f}% of one CPU")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the built-in default model")
    ap.add_argument("--rounds", type=int, default=4, help="A/B pairs")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--screenshot", default=None)
    ap.add_argument("--browser-cpu", action="store_true")
    ap.add_argument("--server-cpu", action="store_true")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--poll-hz", type=float, default=20.0)
    args = ap.parse_args()
    from tokenmill.model.hub import pull

    server = ServerProcess(args.model or pull())
    if args.browser_cpu or args.server_cpu:
        try:
            if args.browser_cpu:
                browser_cpu(server.url)
            else:
                server_cpu(server, args.seconds, args.poll_hz)
        finally:
            server.stop()
        return
    page = None
    results = {"closed": [], "open": []}
    try:
        asyncio.run(load(server.url, args.requests, args.concurrency, args.max_tokens))  # warm-up
        for r in range(args.rounds):
            for state in (("closed", "open") if r % 2 == 0 else ("open", "closed")):
                if state == "open":
                    page = browser()
                    page.get(server.url + "/dashboard")
                    time.sleep(2)
                tps = asyncio.run(load(server.url, args.requests, args.concurrency, args.max_tokens))
                if page is not None:
                    updates = page.execute_script("return window.dashboardUpdates || 0")
                    assert updates > 3, "the page was not polling"
                    if args.screenshot and r == args.rounds - 1:
                        page.save_screenshot(args.screenshot)
                    page.quit()
                    page = None
                results[state].append(tps)
                print(f"round {r} dashboard {state:6s} {tps:7.1f} output tok/s", flush=True)
    finally:
        if page is not None:
            page.quit()
        server.stop()
    closed, opened = statistics.median(results["closed"]), statistics.median(results["open"])
    print(f"median: closed {closed:.1f}, open {opened:.1f} output tok/s; open/closed = {opened / closed:.3f}")


if __name__ == "__main__":
    main()
