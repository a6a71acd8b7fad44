"""Crash trials for `patch`, `convert`, `publish` and `build` (issue 11's crash-harness
bar).

Each trial SIGKILLs the command at a logged step, while its temporary is being written,
or at a random delay within one run's duration (:mod:`crashkit`), then checks:

* no partial file under a final name: the output is absent or exactly what a full run
  writes (``patch``: the delta's target bytes; ``convert`` and ``build``: a package
  ``verify`` accepts; ``publish``: ``repo verify --deep`` OK);
* the next run of the same command succeeds and leaves no stale temporary (``build``:
  its float reference in RAM or beside the output included).

Trial ``n`` of a command is derived from ``(seed, command, n)`` alone, so any subset of
trials can run in any order, in any process (bench/crash_cli.py's ``--jobs`` and resume).

Used by tests/cli/test_crash_cli.py (a few seeded trials) and bench/crash_cli.py (many).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from crashkit import kill_at, run_cli, temporaries

from edgepack.format import Package

__all__ = ["COMMANDS", "Trials"]

PUBLISH_STEPS = ("stored package object", "stored delta ", ".targets.json", ".snapshot.json")
BUILD_STEPS = ("float reference:",)  # the float reference is being written
COMMANDS = ("patch", "convert", "publish", "build")
_SHM = Path("/dev/shm")
_BUILD_RECIPE = (
    '[quantize]\nencodings = ["int4", "int8"]\ngroup_sizes = [32]\n'
    "[calibration]\nsamples = 8\nmax_tokens = 32\n"
)
MiB = 1024 * 1024


class Trials:
    """The inputs (made once in ``work``) and one method per command: ``trial(n)``
    kills a run, checks the invariants and returns the outcome's name."""

    def __init__(self, work: Path, seed: int) -> None:
        self.work, self.seed = work, seed
        self.built = f"b-{work.name}.epk"  # unique: the float reference may go to /dev/shm
        self.scratch = work / "tmp"  # the commands' TMPDIR: what they leave there shows
        self.scratch.mkdir()
        self.env = {**os.environ, "TMPDIR": str(self.scratch)}
        self._setup()

    # ----------------------------------------------------------------- inputs
    def _setup(self) -> None:
        from edgepack.packager.convert import convert
        from edgepack.packager.importers.synthetic import (
            TinyLlamaSpec,
            tiny_llama_weights,
            write_gguf_llama,
        )

        w = self.work
        spec = TinyLlamaSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
        write_gguf_llama(w / "src.gguf", spec, tiny_llama_weights(spec))
        for n in (0, 1):  # the base and the next release: the delta between them
            mutated = dataclasses.replace(spec, seed=n)
            write_gguf_llama(w / f"v{n}.gguf", mutated, tiny_llama_weights(mutated))
            convert(w / f"v{n}.gguf", w / f"v{n}.epk", model_version=f"1.0.{n}")
        rc, lines = run_cli(["diff", str(w / "v0.epk"), str(w / "v1.epk"), "-o", str(w / "d.epkd")])
        assert rc == 0, "".join(lines)
        self.target = (w / "v1.epk").read_bytes()
        self.store = w / "store"
        rc, lines = run_cli(["repo", "init", "--store", str(self.store), *self._keys()])
        assert rc == 0, "".join(lines)
        self.published = 0
        (w / "out").mkdir()
        (w / "recipe.toml").write_text(_BUILD_RECIPE)
        self.durations: dict[str, float] = {}

    def _keys(self) -> list[str]:
        return ["--keys-dir", str(self.work / "keys")]

    def _time(self, command: str) -> float:
        start = time.monotonic()
        rc, lines = run_cli(self._args(command), env=self.env)
        assert rc == 0, "".join(lines)
        return time.monotonic() - start

    def _args(self, command: str) -> list[str]:
        w = self.work
        if command == "patch":
            return ["patch", str(w / "v0.epk"), str(w / "d.epkd"), "-o", str(w / "out" / "p.epk"),
                    "--force"]  # fmt: skip
        if command == "convert":
            return ["convert", str(w / "src.gguf"), "-o", str(w / "out" / "c.epk"), "--force"]
        if command == "build":
            out = str(w / "out" / self.built)
            return ["build", str(w / "src.gguf"), "-o", out, "--recipe", str(w / "recipe.toml"),
                    "--target-bpw", "12", "--force"]  # fmt: skip
        return ["publish", str(self._next_release()), "--store", str(self.store), *self._keys(),
                "--channel", "beta", "--deltas", "1", "-v"]  # fmt: skip

    def _next_release(self) -> Path:
        from edgepack.packager.convert import convert

        self.published += 1
        pkg = self.work / f"r{self.published}.epk"
        convert(self.work / "v0.gguf", pkg, model_version=f"2.0.{self.published}")
        return pkg

    # ------------------------------------------------------------------ trials
    def point(self, command: str, n: int, rng: random.Random) -> str:
        """Odd trials: a random delay; even ones cycle through the command's steps."""
        if n % 2:
            if command not in self.durations:  # one undisturbed run: the delays' range
                self.durations[command] = self._time(command)
            return f"delay:{rng.uniform(0, self.durations[command]):.3f}"
        steps = ["file:.*.partial"]
        if command == "publish":
            steps = [f"log:{s}" for s in PUBLISH_STEPS] + ["file:objects/sha256/.tmp*"]
        if command == "build":
            steps = [f"log:{s}" for s in BUILD_STEPS] + steps
        return steps[(n // 2) % len(steps)]

    def trial(self, command: str, n: int) -> str:
        rng = random.Random(f"{self.seed}:{command}:{n}")
        point = self.point(command, n, rng)
        out_dir = self.work / "out"
        watch = self.store if command == "publish" else out_dir
        killed, lines = kill_at(self._args(command), point, rng, env=self.env, watch=watch)
        assert killed in (None, 0), f"{command} at {point}: exit {killed}: {''.join(lines)}"
        self.CHECKS[command](self)  # after the kill: nothing torn under a final name
        rc, lines = run_cli(self._args(command), env=self.env)  # the next run of the same command
        assert rc == 0, f"{command} after a kill at {point}: {''.join(lines)}"
        self.CHECKS[command](self)
        left = temporaries(watch) + sorted(self.scratch.iterdir()) + self._float_scratch()
        assert left == [], f"{command} after a kill at {point} left {left}"
        return f"{command} {point.split(':')[0]} {'killed' if killed is None else 'finished'}"

    def _float_scratch(self) -> list[Path]:
        """A build's float reference, where it may go besides the output folder."""
        return sorted(_SHM.glob(f".{self.built}.*")) if _SHM.is_dir() else []

    def _check_patch(self) -> None:
        out = self.work / "out" / "p.epk"
        assert not out.exists() or out.read_bytes() == self.target, "torn patch output"

    def _check_convert(self, name: str = "c.epk") -> None:
        out = self.work / "out" / name
        if out.exists():
            with Package.open(out) as pkg:
                pkg.verify()

    def _check_build(self) -> None:
        self._check_convert(self.built)
        out = self.work / "out" / self.built
        md, png = out.with_suffix(".report.md"), out.with_suffix(".report.png")
        if md.exists():  # whole: its table of tensors is there, to the end of a row
            text = md.read_text()
            assert "## Tensors" in text and text.endswith("|\n"), "torn build report"
        if png.exists():
            assert png.read_bytes().endswith(b"IEND\xaeB`\x82"), "torn report plot"

    def _check_publish(self) -> None:
        rc, lines = run_cli(["repo", "verify", "--store", str(self.store), "--deep"])
        assert rc == 0, "".join(lines)

    CHECKS: ClassVar[dict[str, Callable[[Trials], None]]] = {
        "patch": _check_patch,
        "convert": _check_convert,
        "publish": _check_publish,
        "build": _check_build,
    }

    def run(self, trials: int, commands: tuple[str, ...] = COMMANDS) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        for command in commands:
            for n in range(trials):
                outcomes[self.trial(command, n)] += 1
        return outcomes
