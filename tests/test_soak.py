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
