"""The soak, short: a real server under the whole hostile mix for under a minute, with a busy phase."""

from __future__ import annotations

import json
import subprocess
import sys


def test_short_soak_has_no_unexpected_outcome(tiny_models, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "soak", "--model", tiny_models["llama"],
           "--server-args", "--dtype float32", "--phases", "quiet,busy", "--minutes", "0.3", "--warmup", "5",
           "--concurrency", "6", "--burst-every", "8", "--burst-size", "30", "--max-queued-requests", "8",
           "--body-timeout", "3", "--sample-every", "4", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.exists(), done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["outcomes"].get("unexpected", 0) == 0, report["unexpected"]
    assert report["idle_after"] and report["server_tracebacks"] == 0
    kinds = report["by_kind"]
    # The mix really ran: every kind of client came, bad requests were refused as such, bursts past the
    # queue limit met 429s, and stalled uploads were cut with a 408.
    for kind in ("complete", "chat_stream", "long_prompt", "structured", "slow_reader", "leave_stream",
                 "leave_whole", "bad", "burst", "stalled_upload"):
        assert kind in kinds, (kind, kinds)
    assert kinds["bad"].get("expected_4xx", 0) > 0 and "ok" not in kinds["bad"]
    assert kinds["burst"].get("expected_4xx", 0) > 0 and kinds["burst"].get("ok", 0) > 0
    assert kinds["stalled_upload"] == {"expected_4xx": kinds["stalled_upload"]["expected_4xx"]}
    assert set(report["throughput"]) == {"quiet-0", "busy-1"} and all(v > 0 for v in report["throughput"].values())
    assert len(report["samples"]) >= 4 and all(s["rss_mib"] > 0 for s in report["samples"])


def test_busy_latency_is_read_against_the_same_quantile_of_quiet_latency():
    from tokenmill.bench.soak import SoakReport, _compare_phases

    # Quiet latencies spread 10-fold within a kind (short and long answers); busy ones are each 3x slower,
    # except, in a second kind, one request that waited 40x the slowest quiet one.
    quiet = {"structured": [0.5 + 0.05 * i for i in range(91)], "complete": [1.0] * 50 + [2.0] * 50}
    busy = {"structured": [3 * x for x in quiet["structured"]], "complete": [1.0] * 99 + [80.0]}
    report = SoakReport(model="m", minutes_per_phase=1, concurrency=1)
    _compare_phases(report, quiet, busy)
    assert report.quantile_ratios["structured"] == {"p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert report.quantile_ratios["complete"]["max"] == 40.0
    assert (report.worst_latency_ratio, report.worst_latency_ratio_at) == (40.0, "complete max")
    # The cruder reading divides by the kind's quiet median (2.75 s and 1.5 s): the longest quiet answer is
    # already 1.8x it, and the same answer 3x slower 5.5x.
    assert report.quiet_worst_over_quiet_median == round(5.0 / 2.75, 2)
    assert report.worst_over_quiet_median == round(80.0 / 1.5, 2)
    report = SoakReport(model="m", minutes_per_phase=1, concurrency=1)
    _compare_phases(report, {"structured": quiet["structured"]}, {"structured": busy["structured"]})
    assert report.worst_over_quiet_median == round(15.0 / 2.75, 2)
