"""What `edgepack inspect` says about a package's prefix KV caches: tokens, bytes,
whether each is bound to this very package as the runtime opens it by default, and
whether its pages are mapped in place (else copied into the KV pool on first use)."""

from __future__ import annotations

import logging
from typing import Any

from edgepack.format import Package, SectionKind
from edgepack.format.errors import EdgepackError


def prefix_caches_json(pkg: Package) -> list[dict[str, Any]]:
    """One entry per PREFIX_KV_CACHE section; ``binding`` is ``"ok"``, the field that
    differs, or why it could not be checked. Opens the model only when there are any."""
    if not pkg.sections(SectionKind.PREFIX_KV_CACHE):
        return []
    from edgepack import runtime_shim as rt

    log = logging.getLogger("edgepack.runtime")
    level = log.level
    log.setLevel(logging.ERROR)  # the ignored-cache warnings are reported here instead
    try:
        with rt.open(pkg.path, verify="none") as model:
            store = model.prefix_store
            caches = enumerate(store.caches)
            rows = [(name, cache, "ok", i in store.mapped) for i, (name, cache) in caches]
            rows += [(name, cache, f"other {field}", False) for name, cache, field in store.ignored]
    except EdgepackError as exc:
        return [
            {"name": s.name, "bytes": s.data.length, "binding": f"unchecked: {exc}"}
            for s in pkg.sections(SectionKind.PREFIX_KV_CACHE)
        ]
    finally:
        log.setLevel(level)
    return [
        {
            "name": name,
            "tokens": cache.num_tokens,
            "bytes": cache.nbytes,
            "kv_layout": cache.binding.kv_layout,
            "adapter": cache.binding.adapter.hex() or None,
            "binding": status,
            "in_place": in_place,
        }
        for name, cache, status, in_place in rows
    ]


def describe_prefix_caches(pkg: Package) -> list[str]:
    rows = prefix_caches_json(pkg)
    if not rows:
        return []
    lines = [f"  prefix caches {len(rows)}"]
    for r in rows:
        tokens = f"{r['tokens']:>6} tokens " if "tokens" in r else ""
        where = "  mapped in place" if r.get("in_place") else ""
        lines.append(
            f"    {r['name']:<20} {tokens}{r['bytes']:>12,} B  binding {r['binding']}{where}"
        )
    return lines
