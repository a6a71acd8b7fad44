"""edgepack.format: the `.epk` container (spec/FORMAT.md), with no dependency on the rest.

Public API: :class:`Package` to open and verify, :class:`PackageWriter` to write,
:func:`check_compatibility` with :class:`RuntimeCapabilities`, key helpers, and the
error tree in :mod:`edgepack.format.errors`.
"""

from .compat import (
    CompatibilityProblem,
    CompatibilityVerdict,
    RuntimeCapabilities,
    check_compatibility,
    parse_semver,
)
from .constants import Compression, Encoding, SectionKind
from .errors import (
    CorruptPackageError,
    EdgepackError,
    EncodingError,
    IncompatiblePackageError,
    SignatureError,
    TruncatedPackageError,
    UnsupportedFeatureError,
)
from .header import Header, ModelIdentity, Provenance, SectionEntry, Span, TensorEntry
from .reader import Package, QuantizedTensor, VerifyReport
from .signing import generate_keypair, key_id, load_private_key, load_public_key
from .weights_digest import weights_digest
from .writer import PackageWriter

__all__ = [
    "CompatibilityProblem",
    "CompatibilityVerdict",
    "Compression",
    "CorruptPackageError",
    "EdgepackError",
    "Encoding",
    "EncodingError",
    "Header",
    "IncompatiblePackageError",
    "ModelIdentity",
    "Package",
    "PackageWriter",
    "Provenance",
    "QuantizedTensor",
    "RuntimeCapabilities",
    "SectionEntry",
    "SectionKind",
    "SignatureError",
    "Span",
    "TensorEntry",
    "TruncatedPackageError",
    "UnsupportedFeatureError",
    "VerifyReport",
    "check_compatibility",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "parse_semver",
    "weights_digest",
]
