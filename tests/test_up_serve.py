"""``mesh up --serve``: the all-in-one local mesh (SGLang stub engines behind adapters, plus simulated
workers) keeps serving until SIGTERM and says where."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request


def test_up_serve_answers_http_and_stops_on_sigterm(tmp_path):
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "mesh.cli", "up", "--serve", "--workers", "2", "--log-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        url, lines = None, []
        t_end = time.monotonic() + 60
        for line in p.stdout:  # the readiness signal is the "serving" line
            lines.append(line)
            m = re.search(r"OpenAI HTTP\s+(http://\S+)/v1", line)
            if m:
                url = m.group(1)
            if "serving" in line:
                break
            assert time.monotonic() < t_end, lines
        assert url, lines
        text = "".join(lines)
        assert "SGLang engines" in text and "attached as stub-0..stub-1" in text, text
        assert "worker-0..worker-1" not in text, text  # one consistent fleet: attached engines only
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "hello", "max_tokens": 3}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as r:
            body = json.loads(r.read())
            worker = r.headers.get("x-mesh-worker")
        assert body["usage"]["completion_tokens"] == 3
        assert worker in {"stub-0", "stub-1"}, worker  # an engine's adapter
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
