"""Ed25519 keys and package signatures (spec/FORMAT.md section 7).

A signature covers the header digest; the header binds every tensor and section hash,
so checking signatures here plus hashes in the reader authenticates the whole file.

``cryptography`` is imported by the functions that use a key, not with this module: a
process that checks no signature (``edgepack run --verify none``, an app given no trusted
key) never maps its 9 MiB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import flatbuffers

from .constants import DIGEST_SIZE, SIGNATURE_CONTEXT, SignatureAlgorithm
from .digests import sha256
from .errors import InvalidThresholdError, SignatureError
from .schema import Signature as fb_Signature
from .schema import SignatureBlock as fb_Block

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "SignatureEntry",
    "build_signature_block",
    "check_threshold",
    "encode_signature_block",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "parse_signature_block",
    "signature_message",
    "unchecked_signature_warning",
    "verify_signature_block",
]


@dataclass(frozen=True)
class SignatureEntry:
    algorithm: int
    key_id: bytes
    signature: bytes


def key_id(public_key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return sha256(raw).digest()


def signature_message(header_digest: bytes) -> bytes:
    return SIGNATURE_CONTEXT + header_digest


def generate_keypair(name: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write NAME.key (PKCS#8 PEM, mode 0600) and NAME.pub; refuse to overwrite. A NAME
    ending in .key or .pub names the pair (``k1.key`` writes k1.key, not k1.key.key)."""
    base = Path(name)
    if base.suffix in (".key", ".pub"):
        base = base.with_suffix("")
    key_path, pub_path = base.with_name(base.name + ".key"), base.with_name(base.name + ".pub")
    for p in (key_path, pub_path):
        if p.exists():
            raise FileExistsError(f"{p} already exists; refusing to overwrite a key")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key_path, pub_path


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 private key in PEM file ``path`` (``edgepack keygen``'s NAME.key);
    SignatureError saying what the file is when it is something else."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw = _read_key_file(path, "signing key")
    try:
        key = serialization.load_pem_private_key(raw, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(_not_a_key(path, raw, "private", exc)) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(_not_a_key(path, raw, "private"))
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The Ed25519 public key in PEM file ``path`` (``edgepack keygen``'s NAME.pub);
    SignatureError saying what the file is when it is something else."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    raw = _read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(raw)
    except (ValueError, TypeError) as exc:
        raise SignatureError(_not_a_key(path, raw, "public", exc)) from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(_not_a_key(path, raw, "public"))
    return key


def _read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


# PEM labels and key kinds a user may hand us by mistake, and what they are
_PEM_KINDS = (
    (b"-----BEGIN OPENSSH PRIVATE KEY-----", "an OpenSSH private key"),
    (b"-----BEGIN RSA PRIVATE KEY-----", "an RSA private key"),
    (b"-----BEGIN EC PRIVATE KEY-----", "an EC private key"),
    (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", "a password-protected private key"),
    (b"-----BEGIN PUBLIC KEY-----", "a public key"),
    (b"-----BEGIN PRIVATE KEY-----", "a private key"),
    (b"ssh-", "an OpenSSH public key"),
)


def _algorithm(key: object) -> str:
    """"an Ed25519", "an RSA", "an EC" for a key object of those kinds, else ""."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    kinds = (
        (ed25519.Ed25519PrivateKey, "an Ed25519"),
        (ed25519.Ed25519PublicKey, "an Ed25519"),
        (rsa.RSAPrivateKey, "an RSA"),
        (rsa.RSAPublicKey, "an RSA"),
        (ec.EllipticCurvePrivateKey, "an EC"),
        (ec.EllipticCurvePublicKey, "an EC"),
    )
    return next((label for cls, label in kinds if isinstance(key, cls)), "")


def _not_a_key(path: str | os.PathLike[str], raw: bytes, wanted: str, exc=None) -> str:
    """One line: what ``path`` holds and what is needed instead."""
    head = raw.lstrip()[:64]
    what = next((kind for label, kind in _PEM_KINDS if head.startswith(label)), None)
    if what is None:
        what = "not a PEM key"
    elif what in ("a public key", "a private key"):
        kind = what.split()[1]
        from cryptography.hazmat.primitives import serialization

        try:
            key = (
                serialization.load_pem_public_key(raw)
                if kind == "public"
                else serialization.load_pem_private_key(raw, password=None)
            )
            algo = _algorithm(key)
            what = f"{algo} {kind} key" if algo else what
        except (ValueError, TypeError):
            pass
    need = "NAME.key" if wanted == "private" else "NAME.pub"
    return (
        f"{path} is {what}; an Ed25519 {wanted} key in PEM is needed ({need}, made by "
        "`edgepack keygen NAME`)"
    )


def build_signature_block(header_digest: bytes, keys: Iterable[Ed25519PrivateKey]) -> bytes:
    message = signature_message(header_digest)
    return encode_signature_block(
        SignatureEntry(SignatureAlgorithm.ED25519, key_id(key.public_key()), key.sign(message))
        for key in keys
    )


def encode_signature_block(entries: Iterable[SignatureEntry]) -> bytes:
    """The canonical bytes of a block holding ``entries``: the only encoding a reader
    accepts, so the unsigned block cannot be re-encoded into other bytes that verify."""
    b = flatbuffers.Builder(256)
    offsets = []
    for entry in entries:
        kid = b.CreateByteVector(entry.key_id)
        sig = b.CreateByteVector(entry.signature)
        fb_Signature.Start(b)
        fb_Signature.AddAlgorithm(b, entry.algorithm)
        fb_Signature.AddKeyId(b, kid)
        fb_Signature.AddSignature(b, sig)
        offsets.append(fb_Signature.End(b))
    fb_Block.StartSignaturesVector(b, len(offsets))
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    vec = b.EndVector()
    fb_Block.Start(b)
    fb_Block.AddSignatures(b, vec)
    b.Finish(fb_Block.End(b), file_identifier=b"EPKS")
    return bytes(b.Output())


def parse_signature_block(buf: bytes) -> list[SignatureEntry]:
    """Decode a signature block; anything malformed, or encoded other than
    :func:`encode_signature_block` encodes its entries, is a :class:`SignatureError`."""
    if len(buf) < 8 or buf[4:8] != b"EPKS":
        raise SignatureError("signature block is malformed (bad identifier)")
    try:
        block = fb_Block.SignatureBlock.GetRootAs(buf, 0)
        count = block.SignaturesLength()
        if count > 64:
            raise SignatureError(f"signature block holds {count} signatures (max 64)")
        entries = []
        for i in range(count):
            sig = block.Signatures(i)
            kid = bytes(sig.KeyIdAsNumpy().tobytes()) if not sig.KeyIdIsNone() else b""
            raw = bytes(sig.SignatureAsNumpy().tobytes()) if not sig.SignatureIsNone() else b""
            entries.append(SignatureEntry(sig.Algorithm(), kid, raw))
    except SignatureError:
        raise
    except Exception as exc:  # generated accessors raise many kinds on garbage
        raise SignatureError(f"signature block is malformed ({type(exc).__name__})") from None
    if encode_signature_block(entries) != bytes(buf):
        raise SignatureError(
            "signature block is not canonically encoded (its bytes were changed after signing)"
        )
    return entries


def check_threshold(threshold: int) -> int:
    """Refuse a threshold below 1: zero trusted signatures would accept any package."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise InvalidThresholdError(
            f"signature threshold must be an integer of at least 1, got {threshold!r}"
        )
    return threshold


def unchecked_signature_warning(what: str, *, require_signature: bool = False) -> str:
    """The one warning line for ``what`` being used with no signature checked, or (with
    ``require_signature``, for release pipelines) a :class:`SignatureError`."""
    if require_signature:
        raise SignatureError(
            f"{what}: a trusted signature is required (--require-signature) but no "
            "trusted key was given"
        )
    return (
        f"warning: {what}: no trusted key given, the signature is not checked "
        "(anyone could have made or modified it)"
    )


def verify_signature_block(
    block: bytes,
    header_digest: bytes,
    trusted_keys: Sequence[Ed25519PublicKey],
    threshold: int = 1,
) -> list[bytes]:
    """Return the key ids of trusted keys whose signatures verify; raise if < threshold."""
    from cryptography.exceptions import InvalidSignature

    check_threshold(threshold)
    if len(header_digest) != DIGEST_SIZE:
        raise ValueError("header digest must be 32 bytes")
    trusted = {key_id(k): k for k in trusted_keys}
    message = signature_message(header_digest)
    verified: list[bytes] = []
    entries = parse_signature_block(block) if block else []
    for entry in entries:
        key = trusted.get(entry.key_id)
        if key is None or entry.key_id in verified:
            continue
        if entry.algorithm != SignatureAlgorithm.ED25519:
            continue
        try:
            key.verify(entry.signature, message)
        except InvalidSignature:
            raise SignatureError(
                f"signature by trusted key {entry.key_id.hex()[:16]} does not verify: the "
                "package was modified after signing"
            ) from None
        verified.append(entry.key_id)
    if len(verified) < threshold:
        if not entries:
            raise SignatureError("package is not signed")
        signers = ", ".join(e.key_id.hex()[:16] for e in entries)
        raise SignatureError(
            f"package is signed by {signers}, not by a trusted key "
            f"({len(verified)} of {threshold} required)"
        )
    return verified
