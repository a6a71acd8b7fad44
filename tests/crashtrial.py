"""Crash trials of the update client: kill -9 at seeded random crash points, then check
the slot directory (the active model opens and verifies) and that the next run
completes the update. Shared by tests/runtime_shim/test_update_crash.py (60 trials)
and bench/crash.py (1,000).

Two scenarios: ``full`` (empty slot directory -> 1.1.0 by a full download) and
``delta`` (1.0.0 installed -> 1.1.0 by a delta). Crash points (see
edgepack.runtime_shim.update.crashpoints) fall in the download (one per read),
staging, the switch and the health check.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pkgfactory import make_key
from runtime_fixtures import tiny_spec
from serveproc import ServeProcess

from edgepack.packager.convert import convert
from edgepack.packager.importers.synthetic import write_hf_llama
from edgepack.runtime_shim.update import UpdateConfig, Updater, open_slot
from edgepack.runtime_shim.update.crashpoints import CRASH_AT_ENV, CRASH_COUNT_ENV
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

__all__ = ["CrashWorld", "TrialSummary"]

READ_BYTES = 16 * 1024  # small reads: many crash points inside the download
_CHILD = """
import json, sys
from edgepack.runtime_shim.update import UpdateConfig, Updater
url, slots, root = sys.argv[1:4]
u = Updater(url, slots, root, UpdateConfig(read_bytes=int(sys.argv[4])),
            device_id="crash-device", channel="beta", model="tiny")
print(json.dumps(u.check_and_apply().to_json()))
"""


def make_pkg(tmp: Path, version: str, seed: int) -> Path:
    src = tmp / f"hf-{version}"
    spec = tiny_spec()
    weights = {"model.layers.0.self_attn.q_proj.weight": np.random.default_rng(seed).normal(
        0, 0.02, (spec.hidden_size, spec.hidden_size)).astype(np.float32)}
    write_hf_llama(src, spec, extra=weights)
    out = tmp / f"tiny-{version}.epk"
    convert(src, out, encoding="int8", model_version=version, signing_keys=[make_key(0)])
    return out


@dataclass
class TrialSummary:
    trials: int = 0
    killed: int = 0
    completed: int = 0
    by_label: dict[str, int] = field(default_factory=dict)
    refetched_after_download_kill: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        r = self.refetched_after_download_kill
        return {
            "trials": self.trials,
            "killed": self.killed,
            "completed": self.completed,
            "kills_by_point": dict(sorted(self.by_label.items())),
            "download_kills": len(r),
            "max_bytes_refetched_after_download_kill": max(r, default=0),
        }


class CrashWorld:
    """A store with tiny 1.0.0 and 1.1.0 on beta, served; pristine slot directories."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        store = tmp / "store"
        repo = ReleaseRepository(open_store(store), KeyRing(tmp / "keys"))
        repo.init()
        self.v1 = make_pkg(tmp, "1.0.0", 1)
        self.v2 = make_pkg(tmp, "1.1.0", 2)
        repo.publish(self.v1, "beta", model="tiny")
        self.root = tmp / "root.json"
        self.root.write_bytes((store / "metadata" / "1.root.json").read_bytes())
        self.server = ServeProcess(store, tmp / "server.log", "--refresh-seconds", "0.2")
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.pristine = {"full": tmp / "pristine-full", "delta": tmp / "pristine-delta"}
        self.pristine["full"].mkdir()
        assert self._updater(self.pristine["delta"]).check_and_apply().result == "updated"
        repo.publish(self.v2, "beta", model="tiny")
        self.server.stop()  # restart: no waiting for the view to refresh
        self.server = ServeProcess(store, tmp / "server.log", "--refresh-seconds", "0.2")
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.points = {s: self._count(s) for s in self.pristine}

    def close(self) -> None:
        self.server.stop()

    def _updater(self, slots: Path) -> Updater:
        return Updater(self.url, slots, self.root, UpdateConfig(read_bytes=READ_BYTES),
                       device_id="crash-device", channel="beta", model="tiny")

    def _child(self, slots: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", _CHILD, self.url, str(slots), str(self.root), str(READ_BYTES)]
        return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=300)

    def _count(self, scenario: str) -> list[str]:
        slots = self._fresh(scenario, "count")
        log = self.tmp / f"points-{scenario}.txt"
        out = self._child(slots, {CRASH_COUNT_ENV: str(log)})
        assert out.returncode == 0 and json.loads(out.stdout)["result"] == "updated", out.stderr
        return [line.split(" ", 1)[1] for line in log.read_text().splitlines()]

    def _fresh(self, scenario: str, name: str) -> Path:
        slots = self.tmp / "trials" / name
        shutil.rmtree(slots, ignore_errors=True)
        shutil.copytree(self.pristine[scenario], slots)
        return slots

    def trial(self, scenario: str, at: int, summary: TrialSummary) -> None:
        """Kill at crash point ``at`` (1-based), check, complete, check again."""
        slots = self._fresh(scenario, f"{scenario}-{at}")
        out = self._child(slots, {CRASH_AT_ENV: str(at)})
        summary.trials += 1
        assert out.returncode == -9, (at, out.returncode, out.stderr[-2000:])
        summary.killed += 1
        label = self.points[scenario][at - 1]
        summary.by_label[label] = summary.by_label.get(label, 0) + 1
        journal_file = slots / "journal.json"
        if journal_file.exists() and json.loads(journal_file.read_text())["active"]:
            with open_slot(slots, threads=1, verify="full") as model:
                assert np.isfinite(model.logits([1, 2, 3])).all()
        parts = list((slots / "downloads").glob("*.part"))
        missing = _missing_bytes(slots, parts)
        result = self._updater(slots).check_and_apply()
        assert result.result in ("updated", "up_to_date"), (at, label, result)
        with open_slot(slots, threads=1, verify="full") as model:
            assert model.package.path.read_bytes() == self.v2.read_bytes()
        summary.completed += 1
        if label == "download" and parts:
            # what the next run fetched beyond the bytes still missing
            summary.refetched_after_download_kill.append(result.bytes_downloaded - missing)

    def run(self, trials: int, seed: int) -> TrialSummary:
        rng = random.Random(seed)
        summary = TrialSummary()
        for _ in range(trials):
            scenario = rng.choice(sorted(self.pristine))
            self.trial(scenario, rng.randint(1, len(self.points[scenario])), summary)
        return summary


def _missing_bytes(slots: Path, parts: list[Path]) -> int:
    """Bytes of the partial downloads not yet on disk (by the journal's planned lengths)."""
    pending = json.loads((slots / "journal.json").read_text()).get("pending") or {}
    lengths = {t["sha256"]: t["length"] for t in pending.get("targets", [])}
    return sum(lengths[p.name.split(".")[0]] - p.stat().st_size for p in parts)
