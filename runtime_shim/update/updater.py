"""``Updater``: the policy and I/O layer of the device client (ngclient's ``Updater``).

It refreshes TUF metadata (python-tuf's trusted metadata state does the verifying),
asks the server for the cheapest plan, checks the plan against the signed targets,
downloads through :class:`~.fetcher.RangeFetcher` (resumable, chunk-verified), stages
into the inactive slot, verifies, switches via the journal and health-checks, switching
back by itself on failure. An ``adapter`` plan (offered because the check lists
``ADAPTER_PLAN_OPERATOR``) installs an adapter-only package next to the active model
instead: verified, loaded on it (bound to its weights) and health-checked before it is
renamed into place; the active slot never changes. Each step is idempotent on the files
it leaves, so a run after a power cut at any instant resumes where the last one stopped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack.format.constants import ADAPTER_PLAN_OPERATOR
from edgepack.format.errors import EdgepackError

from .config import UpdateConfig
from .crashpoints import crash_point
from .durable import fsync_dir, replace_durably
from .errors import (
    HealthCheckError,
    InsufficientStorageError,
    MetadataError,
    SlotError,
    TargetVerificationError,
    UpdateError,
)
from .plan import PlannedTarget, UpdateCheckResult, verify_plan
from .slots import Journal, SlotDir

__all__ = ["UpdateResult", "Updater"]

Progress = Callable[[int, int], None]
HealthHook = Callable[[Any], None]  # (Model) -> None; raises to fail the check


@dataclass(frozen=True)
class UpdateResult:
    """What one run did: ``result`` is updated, up_to_date, rolled_back or failed."""

    result: str
    plan: str
    version: str | None
    bytes_downloaded: int = 0
    full_bytes: int = 0
    fell_back_to_full: bool = False
    reason: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Updater:
    """Keep the model in ``slot_dir`` current from ``server_url``.

    ``trusted_root`` (bytes or a path of ``root.json``) is needed on first use only;
    after that the slot directory's own TUF metadata is the trust anchor. ``model`` is
    the model name to ask for (default: the installed one's). ``package_keys`` are the
    Ed25519 keys a staged package's signature must verify with (None: hashes only,
    the bytes being TUF-verified anyway). ``health_hook(model)`` runs after the
    built-in health check and fails it by raising.
    """

    def __init__(
        self,
        server_url: str,
        slot_dir: str | os.PathLike[str],
        trusted_root: bytes | str | os.PathLike[str] | None = None,
        config: UpdateConfig | None = None,
        *,
        device_id: str,
        channel: str,
        model: str | None = None,
        package_keys: Sequence[Any] | None = None,
        health_hook: HealthHook | None = None,
        download_allowed: Callable[[], bool] | None = None,
        on_progress: Progress | None = None,
        on_completed: Callable[[UpdateResult], None] | None = None,
        on_failed: Callable[[UpdateResult], None] | None = None,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.slots = SlotDir(slot_dir)
        self.config = config or UpdateConfig()
        self.device_id = device_id
        self.channel = channel
        self.model = model
        self.package_keys = _public_keys(package_keys)
        self.health_hook = health_hook
        self.download_allowed = download_allowed
        self.on_progress = on_progress
        self.on_completed = on_completed
        self.on_failed = on_failed
        self._trusted_root = trusted_root
        self._fetcher = None
        self._tuf = None
        self._check: UpdateCheckResult | None = None
        self._downloaded: Path | None = None
        self.bytes_downloaded = 0
        self.last_error: Exception | None = None  # what made the last run fail

    # -- public API ------------------------------------------------------------------------
    def check(self) -> UpdateCheckResult:
        """Refresh TUF metadata and get a verified plan (``plan == "none"``: nothing)."""
        self._downloaded, self.bytes_downloaded, self.last_error = None, 0, None  # a new run
        self.slots.create()
        self._recover()
        journal = self.slots.load()
        model = self.model or journal.model
        if model is None:
            raise SlotError("nothing installed yet: say which model to install")
        tuf = self._refresh()
        answer = self._ask(model, journal)
        check = verify_plan(
            answer,
            lambda path: self._targetinfo(tuf, path),
            self.config,
            journal.active_version,
            journal.active_sha256,
        )
        if check.plan != "none" and check.installs.sha256 in journal.bad_sha256:
            check = UpdateCheckResult(
                "none", check.release, f"release {check.release} failed its health check here"
            )
        self._check = check
        if check.plan != "none":
            self.slots.save(journal.evolve(state="checked", model=model, pending=check.to_json()))
            crash_point("checked")
        return check

    def download(self, progress: Progress | None = None) -> Path:
        """Fetch the plan's first target (the delta, or the package) verified."""
        check = self._need_check()
        target = check.delta if check.plan == "delta" else check.installs
        return self._download(target, progress)

    def apply(self) -> UpdateResult:
        """Stage, verify, switch and health-check; switch back if unhealthy."""
        check = self._need_check()
        if check.plan == "adapter":
            return self._apply_adapter(check)
        new = self.slots.other(self.slots.load().active)
        fell_back = False
        try:
            downloaded = self._downloaded or self.download(self.on_progress)
            self.slots.save(self.slots.load().evolve(state="staging"))
            crash_point("staging")
            self._stage(check, downloaded, new, delta=check.plan == "delta")
        except (EdgepackError, OSError) as e:
            if check.plan != "delta" or isinstance(e, InsufficientStorageError):
                raise
            fell_back = True  # the delta failed (wrong base, corrupt): the full file, once
            full = self._download(check.package, self.on_progress)
            self._stage(check, full, new, delta=False)
        journal = self.slots.load()
        version = self._version_of(self.slots.model_path(new))
        self._carry_adapters(journal.active, new)
        self.slots.save(journal.evolve(state="staged"))
        crash_point("staged")
        self._switch(new, check.package.sha256, version)
        healthy = self._health_check()
        result = "updated" if healthy is None else "rolled_back"
        return UpdateResult(
            result,
            check.plan,
            version,
            self.bytes_downloaded,
            check.package.length,
            fell_back,
            reason=check.reason if healthy is None else healthy,
        )

    def check_and_apply(self) -> UpdateResult:
        """The whole run; failures become a ``failed`` result (and ``on_failed``)."""
        try:
            check = self.check()
            if check.plan == "none":
                result = UpdateResult(
                    "up_to_date", "none", self.slots.load().active_version, reason=check.reason
                )
            elif self.download_allowed is not None and not self.download_allowed():
                result = UpdateResult(
                    "up_to_date", check.plan, self.slots.load().active_version,
                    full_bytes=check.installs.length, reason="downloading is not allowed now",
                )
            else:
                result = self.apply()
        except (EdgepackError, OSError) as e:
            result = UpdateResult(
                "failed",
                self._check.plan if self._check else "none",
                self._safe_version(),
                self.bytes_downloaded,
                self._check.installs.length if self._check and self._check.installs else 0,
                reason=str(e).splitlines()[0] if str(e) else type(e).__name__,
                error=type(e).__name__,
            )
            self.last_error = e
            if self.on_failed is not None:
                self.on_failed(result)
            return result
        finally:
            self.close()
        if self.on_completed is not None:
            self.on_completed(result)
        return result

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()

    # -- TUF and the update check ------------------------------------------------------------
    def _fetcher_(self):
        if self._fetcher is None:
            from .fetcher import RangeFetcher

            self._fetcher = RangeFetcher(self.config)
        return self._fetcher

    def _refresh(self):
        from .trust import refresh

        self._tuf = refresh(
            self.slots.metadata_dir,
            f"{self.server_url}/metadata/",
            f"{self.server_url}/targets/",
            self._fetcher_(),
            self.config,
            self._trusted_root,
        )
        return self._tuf

    @staticmethod
    def _targetinfo(tuf, path: str):
        from .trust import targetinfo

        return targetinfo(tuf, path)

    def _ask(self, model: str, journal: Journal) -> Any:
        from ..capabilities import runtime_capabilities

        caps = runtime_capabilities()
        body = {
            "device_id": self.device_id,
            "installed_sha256": journal.active_sha256,
            "runtime_version": caps.runtime_version,
            "operator_set_version": max(caps.operator_set_versions),
            "operators": {**caps.operators, ADAPTER_PLAN_OPERATOR: 1},  # it installs them
            "channel": self.channel,
            "model": model,
            "adapters": self.slots.adapter_sha256s(journal.active),
            "free_bytes": shutil.disk_usage(self.slots.root).free,
        }
        url = f"{self.server_url}/v1/update-check"
        status, answer = self._fetcher_().post_json(url, body, self.config.max_check_bytes)
        if status == 409 and isinstance(answer, dict):
            raise InsufficientStorageError(
                str(answer.get("reason", "not enough free space"))[:400],
                needed_bytes=_count(answer.get("needed_bytes")),
                free_bytes=_count(answer.get("free_bytes")),
            )
        if status != 200:
            reason = answer.get("reason") if isinstance(answer, dict) else None
            raise MetadataError(f"the update check was refused (HTTP {status}): {reason}"[:400])
        return answer

    # -- steps -----------------------------------------------------------------------------
    def _need_check(self) -> UpdateCheckResult:
        check = self._check
        if check is None:
            check = self.check()
        if check.plan == "none":
            raise UpdateError("nothing to update: the last check planned nothing")
        return check

    def _download(self, target: PlannedTarget, progress: Progress | None) -> Path:
        from .download import DownloadTarget, download_target

        self._require_space(target.length + self._check.installs.length)
        journal = self.slots.load()
        self.slots.save(journal.evolve(state="downloading"))
        crash_point("downloading")
        dest = self.slots.download_dir / f"{target.sha256}.{target.kind}"
        self._drop_stale_downloads(keep={dest.name for dest in self._wanted_downloads()})
        url = f"{self.server_url}/targets/{target.path}"
        fetched = download_target(
            self._fetcher_(),
            DownloadTarget(url, target.length, target.sha256, target.chunks),
            dest,
            self.config,
            progress,
        )
        self.bytes_downloaded += fetched
        self.slots.save(self.slots.load().evolve(state="downloaded"))
        crash_point("downloaded")
        self._downloaded = dest
        return dest

    def _wanted_downloads(self) -> list[Path]:
        check = self._check
        return [self.slots.download_dir / f"{t.sha256}.{t.kind}" for t in check.targets]

    def _drop_stale_downloads(self, keep: set[str]) -> None:
        for p in self.slots.download_dir.iterdir():
            if p.name.split(".part")[0].split(".etag")[0] not in keep:
                p.unlink(missing_ok=True)

    def _require_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.slots.root).free
        if free < needed + self.config.free_space_margin:
            raise InsufficientStorageError(
                f"{needed} bytes needed in {self.slots.root}, {free} free",
                needed_bytes=needed,
                free_bytes=free,
            )

    def _stage(self, check: UpdateCheckResult, source: Path, slot: str, *, delta: bool) -> None:
        """Make ``slot``'s model the package, verified (skipped when already there)."""
        from .download import file_sha256

        package = check.package
        dest = self.slots.model_path(slot)
        # the slot's adapters were bound to the model it held
        shutil.rmtree(self.slots.adapter_dir(slot), ignore_errors=True)
        if not (dest.exists() and dest.stat().st_size == package.length
                and file_sha256(dest) == package.sha256):
            tmp = dest.with_name(dest.name + ".staging")
            if delta:
                from edgepack.format.delta import apply_delta

                base = self.slots.model_path(self.slots.load().active or "a")
                apply_delta(base, source, tmp, max_target_size=package.length)
            else:
                shutil.copyfile(source, tmp)
            crash_point("staging-written")
            _check_staged(tmp, package, "package")
            replace_durably(tmp, dest)
            crash_point("staging-replaced")
        self._verify_package(dest)

    def _carry_adapters(self, old: str | None, new: str) -> None:
        """Copy ``old``'s adapters into ``new`` when both slots hold the same weights
        (a release that changed only other parts: the adapters stay bound to it)."""
        from edgepack.format import Package

        adapters = self.slots.adapters(old)
        if old is None or not adapters:
            return
        with Package.open(self.slots.model_path(old)) as a, Package.open(
            self.slots.model_path(new)
        ) as b:
            if a.weights_digest != b.weights_digest:
                return
        self.slots.adapter_dir(new).mkdir(parents=True, exist_ok=True)
        for src in adapters:
            tmp = self.slots.adapter_dir(new) / f"{src.name}.staging"
            shutil.copyfile(src, tmp)
            replace_durably(tmp, self.slots.adapter_dir(new) / src.name)

    def _apply_adapter(self, check: UpdateCheckResult) -> UpdateResult:
        """Install the plan's adapter package for the active model (which stays)."""
        from .download import file_sha256

        target = check.adapter
        assert target is not None
        journal = self.slots.load()
        if journal.active is None:
            raise SlotError("an adapter plan needs an installed model to bind to")
        downloaded = self._downloaded or self.download(self.on_progress)
        self.slots.save(self.slots.load().evolve(state="staging"))
        crash_point("staging")
        dest = self.slots.adapter_path(journal.active, target.sha256)
        if not (dest.exists() and file_sha256(dest) == target.sha256):
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".staging")
            shutil.copyfile(downloaded, tmp)
            crash_point("staging-written")
            _check_staged(tmp, target, "adapter")
            self._verify_package(tmp)
            unhealthy = self._adapter_health(self.slots.model_path(journal.active), tmp)
            if unhealthy is not None:
                tmp.unlink()
                j = self.slots.load()
                self.slots.save(
                    j.evolve(state="rolled_back", reason=unhealthy,
                             bad_sha256=(*j.bad_sha256, target.sha256))
                )  # fmt: skip
                return UpdateResult(
                    "rolled_back", "adapter", journal.active_version, self.bytes_downloaded,
                    target.length, reason=unhealthy,
                )  # fmt: skip
            replace_durably(tmp, dest)
            crash_point("staging-replaced")
        self.slots.save(self.slots.load().evolve(state="healthy", reason=""))
        crash_point("health-checked")
        self._clear_downloads()
        return UpdateResult(
            "updated", "adapter", journal.active_version, self.bytes_downloaded,
            target.length, reason=check.reason,
        )  # fmt: skip

    def _adapter_health(self, base: Path, adapter: Path) -> str | None:
        """None when the adapter loads on ``base`` (bound to its weights, covering its
        tensors) and gives finite logits on the health prompt; else the reason."""
        try:
            self._probe(base, adapter)
        except Exception as e:
            return f"adapter health check failed: {type(e).__name__}: {str(e)[:300]}"
        return None

    def _verify_package(self, path: Path) -> None:
        from edgepack.format import Package

        from ..capabilities import runtime_capabilities

        with Package.open(path, capabilities=runtime_capabilities()) as pkg:
            pkg.verify(self.package_keys)

    @staticmethod
    def _version_of(path: Path) -> str:
        from edgepack.format import Package

        with Package.open(path) as pkg:
            return pkg.header.identity.version

    def _switch(self, new: str, sha256: str, version: str) -> None:
        j = self.slots.load()
        self.slots.save(
            j.evolve(
                state="switched",
                active=new,
                active_sha256=sha256,
                active_version=version,
                previous=j.active,
                previous_sha256=j.active_sha256,
                previous_version=j.active_version,
            )
        )
        crash_point("switched")

    def _health_check(self) -> str | None:
        """None when healthy (committed); else the reason, after switching back."""
        j = self.slots.load()
        try:
            self._probe(self.slots.model_path(j.active))
        except Exception as e:
            reason = f"health check failed: {type(e).__name__}: {str(e)[:300]}"
            if j.previous is None:
                # nothing to go back to: serve nothing rather than a broken model
                self.slots.save(
                    j.evolve(
                        state="rolled_back", active=None, active_sha256=None,
                        active_version=None, bad_sha256=(*j.bad_sha256, j.active_sha256),
                        reason=reason,
                    )
                )
                return reason
            self.slots.save(
                j.evolve(
                    state="rolled_back",
                    active=j.previous,
                    active_sha256=j.previous_sha256,
                    active_version=j.previous_version,
                    previous=j.active,
                    previous_sha256=j.active_sha256,
                    previous_version=j.active_version,
                    bad_sha256=(*j.bad_sha256, j.active_sha256),
                    reason=reason,
                )
            )
            crash_point("rolled_back")
            return reason
        crash_point("health-checked")
        self.slots.save(j.evolve(state="healthy", reason=""))
        self._clear_downloads()
        return None

    def _clear_downloads(self) -> None:
        """The installed update's downloads are no longer needed: removed, durably."""
        for p in self.slots.download_dir.iterdir():
            p.unlink(missing_ok=True)
        fsync_dir(self.slots.download_dir)

    def _probe(self, path: Path, adapter: Path | None = None) -> None:
        """The health prompt on ``path`` (under ``adapter``, loaded on it, when given):
        finite logits and the health hook passing, else it raises."""
        import numpy as np

        from ..model import open as open_model

        with open_model(
            path, self.package_keys, threads=self.config.health_threads, verify="full"
        ) as model:
            vocab = model.config.vocab_size
            ids = [i % vocab for i in self.config.health_prompt_ids]
            if adapter is None:
                logits = model.logits(ids)
            else:
                with model.session(adapter=model.load_adapter(adapter)) as s:
                    logits = s.logits(ids)
            if not np.isfinite(logits).all():
                raise HealthCheckError("the forward pass on the health prompt gave NaN/Inf")
            if self.health_hook is not None:
                self.health_hook(model)

    def _recover(self) -> None:
        """Finish what a killed run left: a switch not yet health-checked."""
        j = self.slots.load()
        if j.state == "switched":
            self._health_check()

    def _safe_version(self) -> str | None:
        try:
            return self.slots.load().active_version
        except EdgepackError:
            return None


def _check_staged(tmp: Path, target: PlannedTarget, what: str) -> None:
    """``tmp`` holds the signed target's bytes; else it is removed and refused."""
    from .download import file_sha256

    if tmp.stat().st_size != target.length or file_sha256(tmp) != target.sha256:
        tmp.unlink()
        raise TargetVerificationError(f"the staged {what} does not match the signed {target.path}")


def _count(value: Any) -> int:
    """A byte count from the (unsigned) update-check answer; anything else is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _public_keys(keys: Sequence[Any] | None) -> list[Any] | None:
    """Ed25519 public keys, given as objects or ``.pub`` paths."""
    if keys is None:
        return None
    from edgepack.format.signing import load_public_key

    return [load_public_key(k) if isinstance(k, (str, os.PathLike)) else k for k in keys]
