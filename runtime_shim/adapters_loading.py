"""Find and trust the bytes of a LoRA adapter for a model (see :mod:`.adapters`).

An adapter in the model's own package is covered by the checks the package had at open.
One from an adapter-only package is checked the same way: its signature against the
model's trusted keys (or one warning when the model has none, as at open), its section's
hash as it is read.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from edgepack.format import Package, SectionKind
from edgepack.format.signing import unchecked_signature_warning, verify_signature_block

from .adapters import AdapterHandle, load_payload
from .capabilities import runtime_capabilities
from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .model import Model

__all__ = ["load_adapter"]

_log = logging.getLogger("edgepack.runtime")


def load_adapter(
    model: Model, source: str | os.PathLike[str] | None, name: str | None
) -> AdapterHandle:
    if source is None:
        return _from_package(model, model.package, name)
    keys, threshold, require = model.adapter_trust
    with Package.open(source, capabilities=runtime_capabilities()) as pkg:
        if keys is not None:
            digest = pkg.preamble.header_digest
            verify_signature_block(pkg.signature_block(), digest, keys, threshold)
        else:
            _log.warning(unchecked_signature_warning(f"{source}", require_signature=require))
        return _from_package(model, pkg, name)


def _from_package(model: Model, pkg: Package, name: str | None) -> AdapterHandle:
    sections = pkg.sections(SectionKind.LORA_ADAPTER)
    names = [s.name for s in sections]
    if name is not None and name not in names:
        raise InvalidRequestError(f"{pkg.path} has no adapter {name!r} (it has: {names or 'none'})")
    if name is None and len(names) != 1:
        raise InvalidRequestError(
            f"{pkg.path} holds {len(names)} adapters; give a name: {', '.join(names) or 'none'}"
        )
    payload = pkg.section(SectionKind.LORA_ADAPTER, name if name is not None else names[0])
    assert payload is not None
    base = model.package
    shapes = {t.name: t.shape for t in base.header.tensors}
    return load_payload(payload, base.weights_digest, shapes, model.config.num_layers)
