"""``ovshard keygen``: a cluster CA and one certificate per node, for the mutual TLS of ``wire/tls.py``.

Layout written (``folder`` is new, empty, or with ``force`` an earlier keygen folder, replaced whole)::

    folder/ca.pem            the cluster CA certificate
    folder/ca.key            the CA's private key (0600): keep it offline, it signs new nodes
    folder/<name>/ca.pem     a copy of the CA certificate
    folder/<name>/cert.pem   the node's certificate: CN=<name>, OU=head|stage, signed by the CA
    folder/<name>/key.pem    the node's private key (0600)

Everything is written into a temporary folder next to ``folder`` and renamed into place, so a failure
leaves nothing half-written. Keys are EC P-256. This is the only module that needs ``cryptography``
(the ``ovshard[secure]`` extra); it is imported inside :func:`keygen`, so a serving node never loads it.
A tool, not the wire: it writes credentials once, where keys are made; the wire only loads them.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ovshard.errors import CredentialsError, OvshardError
from ovshard.runtime.wire.tls import CA_FILE, CERT_FILE, KEY_FILE, ROLES

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger(__name__)

CA_KEY_FILE = "ca.key"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RESERVED = (CA_FILE, CA_KEY_FILE)
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates are valid from a little before now


def keygen(folder: Path, stages: list[str], heads: list[str], days: int = 825,
           force: bool = False) -> list[Path]:
    """Write a cluster CA and a node folder per name (stages, then heads); return the node folders."""
    try:
        import cryptography  # noqa: F401
    except ImportError as e:
        raise OvshardError("ovshard keygen needs the cryptography package: pip install 'ovshard[secure]'") from e
    folder = Path(folder)
    nodes = _check_nodes(stages, heads)
    if days < 1:
        raise CredentialsError(f"--days: expected a validity of at least 1 day, found {days}")
    _check_target(folder, force)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        _write_all(tmp, nodes, days)
        _move_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("keygen: CA and %d node certificates in %s", len(nodes), folder)
    return [folder / name for name, _ in nodes]


def _check_nodes(stages: list[str], heads: list[str]) -> list[tuple[str, str]]:
    """(name, role) pairs; names unique, safe as folder names and certificate CNs."""
    if not stages or not heads:
        raise CredentialsError(f"keygen: expected at least one stage and one head name, found stages "
                               f"{stages}, heads {heads}; e.g. --stages s0,s1 --heads head")
    nodes = [(n, "stage") for n in stages] + [(n, "head") for n in heads]
    seen: set[str] = set()
    for name, _ in nodes:
        if not _NAME.fullmatch(name) or name.startswith(".") or name in _RESERVED:
            raise CredentialsError(f"node name {name!r}: expected 1 to 64 of A-Z a-z 0-9 _ . - (not starting "
                                   f"with '.', not {' or '.join(_RESERVED)}); rename it, e.g. stage0")
        if name in seen:
            raise CredentialsError(f"node name {name!r}: expected each name once (over --stages and "
                                   "--heads), found it twice; give every node its own name")
        seen.add(name)
    return nodes


def _check_target(folder: Path, force: bool) -> None:
    """A new or empty folder, or an earlier keygen folder with force; nothing else is replaced."""
    if folder.exists() and not folder.is_dir():
        raise CredentialsError(f"-o {folder}: expected a folder for the keys, found a file; choose another path")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not (folder / CA_KEY_FILE).is_file():
        raise CredentialsError(f"-o {folder}: expected a new or empty folder (or an earlier keygen output), "
                               f"found other files and no {CA_KEY_FILE}; choose another folder")
    if not force:
        raise CredentialsError(f"-o {folder}: it already holds a cluster CA ({CA_KEY_FILE}); replacing it "
                               "makes every node's certificate useless. Pass --force (force=True) to "
                               "replace the whole folder, or choose another folder")


def _write_all(root: Path, nodes: list[tuple[str, str]], days: int) -> None:
    """The CA and every node, into ``root``."""
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, now, days)
    _write(root / CA_FILE, _cert_pem(ca_cert))
    _write(root / CA_KEY_FILE, _key_pem(ca_key), private=True)
    for name, role in nodes:
        key = ec.generate_private_key(ec.SECP256R1())
        (root / name).mkdir()
        _write(root / name / CA_FILE, _cert_pem(ca_cert))
        _write(root / name / CERT_FILE, _cert_pem(_node_certificate(name, role, key, ca_key, ca_cert, now, days)))
        _write(root / name / KEY_FILE, _key_pem(key), private=True)
        log.debug("keygen: %s (%s)", name, role)


def _ca_certificate(key: ec.EllipticCurvePrivateKey, now: datetime.datetime, days: int) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    # a CN of its own per run: another run's CA is then told apart by name, not only by signature
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ovshard"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"ovshard cluster CA {secrets.token_hex(4)}")])
    public = key.public_key()
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))


def _node_certificate(name: str, role: str, key: ec.EllipticCurvePrivateKey, ca_key: ec.EllipticCurvePrivateKey,
                      ca_cert: x509.Certificate, now: datetime.datetime, days: int) -> x509.Certificate:
    """CN=name, OU=role; both serverAuth and clientAuth: every node listens and connects."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    assert role in ROLES
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ovshard"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    public = key.public_key()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=False, crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Create ``path`` (it must not exist); a private file is 0600 from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if private:
        os.chmod(path, 0o600)  # whatever the umask


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename the finished ``tmp`` to ``folder``; an earlier folder (checked by _check_target) goes."""
    if not folder.exists() or not any(folder.iterdir()):
        os.replace(tmp, folder)  # onto nothing, or onto an empty folder: one atomic rename
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
    os.replace(folder, old / folder.name)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _names(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


