"""Mutual TLS between the nodes of one cluster: credentials on disk, SSL contexts, peer identity.

Every node (the head and each stage worker) holds a folder made by ``ovshard keygen``: ``ca.pem`` (the
cluster CA, the only trust anchor), ``cert.pem`` (this node, signed by that CA) and ``key.pem`` (its
private key, mode 0600). A certificate names its node in the subject's commonName (CN) and its role,
``head`` or ``stage``, in the organizationalUnitName (OU).

Both ends present a certificate and both verify the other's against the cluster CA (TLS 1.3 only).
Host names are *not* checked (``check_hostname = False``): nodes are addressed by IP, often private
ones, and trust comes from the cluster CA, not from DNS names. A certificate signed by the cluster CA is
therefore accepted from any address; who a peer is comes from :func:`peer_identity`.

In TLS 1.3 a client learns that the server refused *its* certificate only on its first read after the
handshake, not in ``do_handshake``; :func:`handshake_error` turns either side's failure into a message
that says what to do.

This module needs only the standard library (``cryptography`` is used by ``ovshard keygen`` alone).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from ovshard.errors import CredentialsError

log = logging.getLogger(__name__)

ROLES = ("head", "stage")
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
_EXPECTED = f"expected {CA_FILE}, {CERT_FILE} and {KEY_FILE} (made by `ovshard keygen`)"


@dataclass(frozen=True)
class Credentials:
    """One node's TLS material (paths) and the identity its certificate carries."""

    folder: Path
    ca: Path
    cert: Path
    key: Path
    role: str
    name: str


def load_credentials(folder: Path) -> Credentials:
    """Check a ``--credentials`` folder and read its identity: files present, key private, cert signed by
    the CA with a known role. The check is a TLS handshake of the node with itself, in memory."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CredentialsError(f"--credentials {folder}: {_EXPECTED}, found no such folder")
    ca, cert, key = folder / CA_FILE, folder / CERT_FILE, folder / KEY_FILE
    missing = [p.name for p in (ca, cert, key) if not p.is_file()]
    if missing:
        raise CredentialsError(f"--credentials {folder}: {_EXPECTED}, missing {', '.join(missing)}")
    _check_private(key)
    draft = Credentials(folder, ca, cert, key, role="", name="")
    peer = _self_handshake(server_context(draft), client_context(draft), folder)
    role, name = _identity(peer, str(cert))
    log.debug("credentials %s: role %s, name %s", folder, role, name)
    return Credentials(folder, ca, cert, key, role, name)


def _check_private(key: Path) -> None:
    """A private key readable by group or others is refused (as ssh does)."""
    if os.name != "posix":
        return
    mode = stat.S_IMODE(key.stat().st_mode)
    if mode & 0o077:
        raise CredentialsError(f"{key}: expected a private key readable by its owner only (mode 0600), "
                               f"found mode {mode:04o}; run `chmod 600 {key}`")


def _context(protocol: int, creds: Credentials) -> ssl.SSLContext:
    """TLS 1.3, this node's certificate, the cluster CA as the only trust anchor, peer cert required."""
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(creds.cert, creds.key)
    except ssl.SSLError as e:
        raise CredentialsError(f"{creds.cert} and {creds.key}: expected a PEM certificate and its own "
                               f"private key, found {e.reason or e}; copy the node folder from the "
                               "`ovshard keygen` output again") from e
    try:
        ctx.load_verify_locations(cafile=creds.ca)
    except ssl.SSLError as e:
        raise CredentialsError(f"{creds.ca}: expected the cluster CA certificate (PEM), found "
                               f"{e.reason or e}; copy it from the `ovshard keygen` output again") from e
    if protocol == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # nodes are addressed by IP: trust comes from the cluster CA
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def server_context(creds: Credentials) -> ssl.SSLContext:
    """For a listening node: TLS 1.3, presents its certificate, requires a client certificate from the
    cluster CA (mutual authentication)."""
    return _context(ssl.PROTOCOL_TLS_SERVER, creds)


def client_context(creds: Credentials) -> ssl.SSLContext:
    """For a connecting node: TLS 1.3, presents its certificate, requires the server's certificate to come
    from the cluster CA; host names are not checked (see the module docstring)."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, creds)


def _self_handshake(server: ssl.SSLContext, client: ssl.SSLContext, folder: Path) -> dict:
    """Handshake the node with itself over memory buffers; the server side's view of the client cert."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = [client.wrap_bio(c_in, c_out), server.wrap_bio(s_in, s_out, server_side=True)]
    done = [False, False]
    for _ in range(8):  # TLS 1.3 needs two round trips
        for i, end in enumerate(ends):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as e:
                    raise CredentialsError(
                        f"--credentials {folder}: expected {CERT_FILE} signed by {CA_FILE}, found that it "
                        f"does not verify ({e.verify_message}); {CERT_FILE} and {CA_FILE} must come from "
                        "the same `ovshard keygen` run: copy that node folder again") from e
                except ssl.SSLError as e:
                    raise CredentialsError(f"--credentials {folder}: a TLS handshake of this node with "
                                           f"itself failed ({e.reason or e}); {_EXPECTED}") from e
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done):
            return ends[1].getpeercert() or {}
    raise CredentialsError(f"--credentials {folder}: a TLS handshake of this node with itself did not "
                           "finish; please report this")


def _identity(cert: dict, where: str) -> tuple[str, str]:
    """(role, name) from a decoded certificate's subject: OU and CN."""
    subject = {key: value for rdn in cert.get("subject", ()) for key, value in rdn}
    role, name = subject.get("organizationalUnitName"), subject.get("commonName")
    if role not in ROLES or not name:
        raise CredentialsError(f"{where}: expected a certificate with OU={' or OU='.join(ROLES)} and a CN "
                               f"(made by `ovshard keygen`), found OU={role!r}, CN={name!r}")
    return role, name


def peer_identity(sock: ssl.SSLSocket | ssl.SSLObject) -> tuple[str, str]:
    """(role, name) of the peer of a completed handshake, from its verified certificate."""
    try:
        cert = sock.getpeercert()
    except ValueError:  # the handshake has not happened yet
        cert = None
    if not cert:
        raise CredentialsError("expected the peer's verified certificate, found none: the socket needs a "
                               "context from server_context/client_context and a completed handshake")
    return _identity(cert, "peer certificate")


def handshake_error(exc: OSError, peer: str) -> CredentialsError:
    """A clear error for a failed TLS handshake (or the first read after it) with ``peer`` (host:port)."""
    reason = getattr(exc, "reason", None) or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        what = (f"its certificate does not verify against our {CA_FILE} ({exc.verify_message}): it holds "
                "credentials of another `ovshard keygen` run (another CA) or they expired")
    elif "CERTIFICATE_REQUIRED" in reason or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason:
        what = "one end sent no certificate: every node needs --credentials (mutual TLS)"
    elif "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "DECRYPT_ERROR" in reason:
        what = (f"it refused our certificate ({reason}): it trusts another CA, i.e. holds credentials "
                "of another `ovshard keygen` run")
    elif "WRONG_VERSION_NUMBER" in reason or "HTTP_REQUEST" in reason or "UNSUPPORTED_PROTOCOL" in reason:
        what = f"it does not speak TLS 1.3 ({reason}): is it running with --insecure, or an older ovshard?"
    else:
        what = f"{reason or exc}"
    return CredentialsError(f"TLS handshake with {peer} failed: {what}; expected both ends to hold node "
                            "folders from the same `ovshard keygen` run (--credentials)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: 127.0.0.0/8, ::1 (also IPv4-mapped) or localhost."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def check_listen_posture(host: str, creds: Credentials | None, insecure: bool) -> None:
    """Refuse to listen beyond loopback without credentials, unless ``insecure`` was asked for."""
    if creds is not None or insecure or is_loopback(host):
        return
    raise CredentialsError(f"--listen {host}: expected --credentials DIR (made by `ovshard keygen`) to "
                           "listen on an address other machines can reach, found none; pass "
                           "--credentials, listen on 127.0.0.1, or pass --insecure on a trusted network")
