"""Mutual TLS: real handshakes over loopback between keygen's credentials, refusals, and clear credential errors."""

from __future__ import annotations

import dataclasses
import datetime
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from ovshard.errors import CredentialsError, OvshardError
from ovshard.runtime.tools import keygen as kg
from ovshard.runtime.wire.tls import (
    Credentials,
    check_listen_posture,
    client_context,
    handshake_error,
    is_loopback,
    load_credentials,
    peer_identity,
    server_context,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kg.keygen(tmp_path_factory.mktemp("a") / "keys", ["s0", "s1"], ["head"])[0].parent


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another keygen run: another CA, the same node names."""
    return kg.keygen(tmp_path_factory.mktemp("b") / "keys", ["s0"], ["head"])[0].parent


@dataclass
class Exchange:
    """What each end of one connection saw: the peer's (role, name), or the exception it got."""

    server: tuple[str, str] | BaseException | None = None
    client: tuple[str, str] | BaseException | None = None
    client_read: bytes | BaseException | None = None


def _exchange(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> Exchange:
    """One real TCP connection on loopback: TLS handshake on both ends, then one byte server -> client."""
    seen = Exchange()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                seen.server = peer_identity(tls)
                tls.sendall(b"!")
        except (OSError, OvshardError) as e:
            seen.server = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        raw = socket.create_connection(listener.getsockname(), timeout=5)
        with client_ctx.wrap_socket(raw) as tls:
            seen.client = peer_identity(tls)
            try:  # TLS 1.3: a refused client certificate shows up on the client's first read
                seen.client_read = tls.recv(1)
            except OSError as e:
                seen.client_read = e
    except OSError as e:
        seen.client = e
    thread.join(10)
    listener.close()
    return seen


def test_load_credentials_reads_role_and_name_from_the_certificate(cluster: Path) -> None:
    """Each node folder loads, with OU as the role and CN as the name."""
    assert [(c.role, c.name) for c in map(load_credentials, (cluster / "s0", cluster / "head"))] == \
        [("stage", "s0"), ("head", "head")]


def test_head_and_stage_complete_mutual_tls_and_see_each_other(cluster: Path) -> None:
    """A head client and a stage server handshake (TLS 1.3) and each learns the other's role and name."""
    seen = _exchange(server_context(load_credentials(cluster / "s0")),
                     client_context(load_credentials(cluster / "head")))
    assert (seen.server, seen.client, seen.client_read) == (("head", "head"), ("stage", "s0"), b"!")


def test_a_stage_connects_to_the_next_stage(cluster: Path) -> None:
    """Stage certificates serve as client certificates too (s0 forwarding to s1)."""
    seen = _exchange(server_context(load_credentials(cluster / "s1")),
                     client_context(load_credentials(cluster / "s0")))
    assert (seen.server, seen.client) == (("stage", "s0"), ("stage", "s1"))


def test_server_refuses_a_client_certificate_of_another_ca(cluster: Path, other: Path) -> None:
    """A client holding another run's cert (even trusting our CA) is refused by the server's verification."""
    impostor = dataclasses.replace(load_credentials(other / "head"), ca=cluster / "ca.pem")
    seen = _exchange(server_context(load_credentials(cluster / "s0")), client_context(impostor))
    assert isinstance(seen.server, ssl.SSLCertVerificationError), seen
    assert "another `ovshard keygen` run" in str(handshake_error(seen.server, "10.0.0.2:51000"))
    assert not isinstance(seen.client_read, bytes) or seen.client_read == b"", seen


def test_client_refuses_a_server_of_another_ca(cluster: Path, other: Path) -> None:
    """A head refuses a stage server whose certificate comes from another CA, in its handshake."""
    seen = _exchange(server_context(load_credentials(other / "s0")),
                     client_context(load_credentials(cluster / "head")))
    assert isinstance(seen.client, ssl.SSLCertVerificationError), seen
    message = str(handshake_error(seen.client, "10.0.0.1:7000"))
    assert "10.0.0.1:7000" in message and "another `ovshard keygen` run" in message
    assert isinstance(seen.server, ssl.SSLError) and "refused our certificate" in str(
        handshake_error(seen.server, "peer"))


def test_server_refuses_a_client_without_certificate(cluster: Path) -> None:
    """A TLS client that presents no certificate is refused: client certificates are required."""
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cluster / "ca.pem")
    seen = _exchange(server_context(load_credentials(cluster / "s0")), bare)
    assert isinstance(seen.server, ssl.SSLError), seen
    assert "sent no certificate" in str(handshake_error(seen.server, "peer"))
    assert isinstance(seen.client_read, ssl.SSLError), seen
    assert "sent no certificate" in str(handshake_error(seen.client_read, "peer"))


def test_server_refuses_tls_1_2(cluster: Path) -> None:
    """A client limited to TLS 1.2 cannot connect: TLS 1.3 is the minimum."""
    old = client_context(load_credentials(cluster / "head"))
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_2
    seen = _exchange(server_context(load_credentials(cluster / "s0")), old)
    assert isinstance(seen.server, ssl.SSLError) and isinstance(seen.client, ssl.SSLError), seen


def test_peer_identity_without_a_handshake_is_an_error(cluster: Path) -> None:
    """peer_identity refuses a TLS object that holds no verified peer certificate."""
    obj = client_context(load_credentials(cluster / "head")).wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO())
    with pytest.raises(CredentialsError, match="expected the peer's verified certificate"):
        peer_identity(obj)


def _copy_node(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (target / name).write_bytes((source / name).read_bytes())
    (target / "key.pem").chmod(0o600)
    return target


def test_load_credentials_names_a_missing_file(cluster: Path, tmp_path: Path) -> None:
    """A folder without key.pem (or no folder at all) is a clear error naming what is missing."""
    node = _copy_node(cluster / "s0", tmp_path / "s0")
    (node / "key.pem").unlink()
    with pytest.raises(CredentialsError, match=r"expected ca.pem, cert.pem and key.pem .*missing key.pem"):
        load_credentials(node)
    with pytest.raises(CredentialsError, match="no such folder"):
        load_credentials(tmp_path / "nowhere")


def test_load_credentials_refuses_a_key_readable_by_others(cluster: Path, tmp_path: Path) -> None:
    """key.pem with mode 0644 is refused, and the message says to chmod 600."""
    node = _copy_node(cluster / "s0", tmp_path / "s0")
    (node / "key.pem").chmod(0o644)
    with pytest.raises(CredentialsError, match=r"found mode 0644; run `chmod 600"):
        load_credentials(node)


def test_load_credentials_refuses_a_cert_not_signed_by_its_ca(cluster: Path, other: Path, tmp_path: Path) -> None:
    """cert.pem from one run with ca.pem from another is refused before any connection."""
    node = _copy_node(cluster / "s0", tmp_path / "s0")
    (node / "ca.pem").write_bytes((other / "ca.pem").read_bytes())
    with pytest.raises(CredentialsError, match=r"expected cert.pem signed by ca.pem, found that it does not"):
        load_credentials(node)


def test_load_credentials_refuses_a_cert_without_a_known_role(cluster: Path, tmp_path: Path) -> None:
    """A certificate signed by the CA but with OU=worker is refused, naming the roles expected."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    node = _copy_node(cluster / "s0", tmp_path / "s0")
    ca_key = serialization.load_pem_private_key((cluster / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((cluster / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((node / "key.pem").read_bytes(), None)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = kg._node_certificate("s0", "stage", key, ca_key, ca_cert, now, 1)  # type: ignore[arg-type]
    subject = x509.Name([a if a.oid != x509.oid.NameOID.ORGANIZATIONAL_UNIT_NAME
                         else x509.NameAttribute(a.oid, "worker") for a in cert.subject])
    builder = x509.CertificateBuilder(issuer_name=cert.issuer, subject_name=subject, public_key=cert.public_key(),
                                      serial_number=cert.serial_number, not_valid_before=cert.not_valid_before_utc,
                                      not_valid_after=cert.not_valid_after_utc, extensions=list(cert.extensions))
    forged = builder.sign(ca_key, cert.signature_hash_algorithm)  # type: ignore[arg-type]
    (node / "cert.pem").write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(CredentialsError, match=r"expected a certificate with OU=head or OU=stage.*'worker'"):
        load_credentials(node)


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("10.0.0.1", False), ("128.0.0.1", False), ("192.168.1.2", False), ("example.com", False),
])
def test_is_loopback(host: str, expected: bool) -> None:
    """Loopback is 127.0.0.0/8, ::1 (also IPv4-mapped) and localhost; a wildcard or LAN address is not."""
    assert is_loopback(host) is expected


def test_listening_beyond_loopback_needs_credentials_or_insecure(cluster: Path) -> None:
    """Without credentials, 0.0.0.0 is refused unless insecure; loopback and credentials are accepted."""
    with pytest.raises(CredentialsError, match="--insecure"):
        check_listen_posture("0.0.0.0", None, insecure=False)
    check_listen_posture("0.0.0.0", None, insecure=True)
    check_listen_posture("127.0.0.1", None, insecure=False)
    creds: Credentials = load_credentials(cluster / "s0")
    check_listen_posture("0.0.0.0", creds, insecure=False)


