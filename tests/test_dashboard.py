"""GET /dashboard: the timeline behind it, its data endpoint, and the page in a real headless browser."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from tests.server_utils import ServerProcess
from tokenmill.server.dashboard import Timeline, percentiles


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_timeline_buckets_seconds_and_percentiles():
    clock = Clock(1000.0)
    stats = {"num_requests_running": 2, "num_requests_waiting": 1, "kv_cache_usage_perc": 0.25,
             "prefix_cache_queries": 100, "prefix_cache_hits": 0}
    tl = Timeline(clock)
    tl.stats_source = lambda: dict(stats)
    tl.record(1000.1, tokens=5, ttft=[0.010, 0.030])
    tl.record(1000.6, tokens=7, itl=[0.002] * 7)
    stats.update(prefix_cache_queries=200, prefix_cache_hits=75, num_requests_running=0)
    tl.record(1002.2, tokens=3, itl=[0.004] * 3, finished=2)
    snap = tl.snapshot(now=1003.5)
    pts = {p["t"]: p for p in snap["points"]}
    assert sorted(pts) == [1000, 1001, 1002]  # the current second (1003) is still filling
    assert [pts[t]["tokens_per_s"] for t in (1000, 1001, 1002)] == [12, 0, 3]
    assert pts[1000]["ttft_ms"] == {"p50": 10.0, "p90": 30.0, "p99": 30.0}
    assert pts[1001]["ttft_ms"] == pts[1000]["ttft_ms"]  # a 5-second span behind each point
    assert pts[1002]["itl_ms"]["p99"] == 4.0 and pts[1002]["itl_ms"]["p50"] == 2.0
    assert pts[1002]["finished"] == 2 and pts[1002]["running"] == 0 and pts[1001]["running"] == 2
    assert pts[1002]["prefix_cache_hit_rate"] == 0.75  # 75 of the 100 tokens looked up since the last sample
    assert snap["gauges"]["prefix_cache_hits"] == 75
    assert [p["t"] for p in tl.snapshot(since=1001, now=1003.5)["points"]] == [1002]
    # the engine thread's clock read just before the server's: its step lands in the newest second
    tl.snapshot(now=1005.001)
    tl.record(1004.999, tokens=4, finished=1)
    assert sum(p["tokens_per_s"] for p in tl.snapshot(now=1007.0)["points"]) == 12 + 3 + 4
    assert percentiles([]) is None
    assert percentiles([i / 1000 for i in range(1, 101)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_stats_endpoint_follows_a_load_and_is_guarded(tiny_models):
    server = ServerProcess(tiny_models["llama"], "--dtype", "float32", "--api-key", "sekrit")
    try:
        assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 200  # the page holds no data
        assert httpx.get(server.url + "/dashboard/stats", timeout=10).status_code == 401
        auth = {"Authorization": "Bearer sekrit"}
        for _ in range(6):
            r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                           json={"prompt": "hello " * 20, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        time.sleep(1.1)  # let the second of the last request complete
        snap = httpx.get(server.url + "/dashboard/stats", headers=auth, timeout=10).json()
        assert sum(p["tokens_per_s"] for p in snap["points"]) == 6 * 16
        assert sum(p["finished"] for p in snap["points"]) == 6
        assert any(p["ttft_ms"] for p in snap["points"])
        assert snap["gauges"]["prefix_cache_hits"] > 0  # the same prompt six times
        assert snap["model"] and snap["status"] == "ok" and "temperature" in snap["sampling_defaults"]
        last = snap["points"][-1]["t"]
        newer = httpx.get(server.url + f"/dashboard/stats?since={last}", headers=auth, timeout=10).json()
        assert all(p["t"] > last for p in newer["points"])
        assert httpx.get(server.url + "/dashboard/stats?since=soon", headers=auth, timeout=10).status_code == 400
    finally:
        server.stop()


def _browser():
    """Debian's chromium through its chromedriver, headless; None where they are not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.mark.slow
def test_dashboard_page_plots_a_live_load(tiny_models, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium/chromedriver here (scripts/test.sh installs them where apt can)")
    server = ServerProcess(tiny_models["llama"], "--dtype", "float32")
    stop = threading.Event()

    def load():
        while not stop.is_set():
            httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "once upon a time", "max_tokens": 32, "temperature": 0.8})

    try:
        browser.get(server.url + "/dashboard")
        deadline = time.monotonic() + 20
        while browser.execute_script("return window.dashboardUpdates || 0") < 2:
            assert time.monotonic() < deadline, "the page never received statistics"
            time.sleep(0.2)
        assert browser.find_element("id", "status").text == "ok"
        assert browser.find_element("id", "t-tps").text in ("0.0", "–")  # nothing has run yet
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        deadline = time.monotonic() + 30
        while True:  # the tiles and plots follow the load
            tps = browser.find_element("id", "t-tps").text
            if tps not in ("0.0", "–") and float(tps) > 0 and browser.find_element("id", "t-ttft").text != "–":
                break
            assert time.monotonic() < deadline, f"the page did not show the load (tok/s {tps})"
            time.sleep(0.3)
        # something was drawn: the tok/s canvas holds non-background pixels in the series colour
        drawn = browser.execute_script("""
            const c = document.getElementById('c-tps'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] === 0x2f && d[i+1] === 0x6f && d[i+2] === 0xde) n++;
            return n;""")
        assert drawn > 20
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        if os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT"):
            browser.save_screenshot(os.environ["TOKENMILL_DASHBOARD_SCREENSHOT"])
        errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        stop.set()
        browser.quit()
        server.stop()
