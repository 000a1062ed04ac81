"""The demo end to end: a torchrun job loses a rank to SIGKILL and resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_resumes_exactly_after_a_kill(tmp_path) -> None:
    cmd = [sys.executable, "-m", "dcp_volumes.cli", "demo", "--json", "--steps", "14",
           "--save-every", "4", "--crash-at", "10", "--files", "40",
           "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is True
    assert result["mismatched_steps"] == []
    assert result["reference_digest"] == result["crashed_digest"]
    # The kill came after step 8 was saved: the restart resumes from a checkpoint, not from 0.
    assert result["resumed_from"] in (4, 8)
    samples = (tmp_path / "crashed.samples.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in samples]
    assert max(steps) == 14 and len(steps) > 14, "steps after the checkpoint were redone"
