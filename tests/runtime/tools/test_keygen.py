"""``ovshard keygen``: the files it writes and their modes, refused names and folders, nothing left
half-written, the command's output, and that serving never loads ``cryptography``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from ovshard.errors import CredentialsError, OvshardError
from ovshard.runtime.tools import keygen as kg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kg.keygen(tmp_path_factory.mktemp("a") / "keys", ["s0", "s1"], ["head"])[0].parent


def test_keygen_writes_a_ca_and_a_folder_per_node_with_private_keys(cluster: Path) -> None:
    """keygen writes ca.pem + ca.key and ca.pem/cert.pem/key.pem per node; every key is mode 0600."""
    assert sorted(p.name for p in cluster.iterdir()) == ["ca.key", "ca.pem", "head", "s0", "s1"]
    for node in ("head", "s0", "s1"):
        assert sorted(p.name for p in (cluster / node).iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
        assert (cluster / node / "ca.pem").read_bytes() == (cluster / "ca.pem").read_bytes()
    for key in (cluster / "ca.key", *(cluster / n / "key.pem" for n in ("head", "s0", "s1"))):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


@pytest.mark.parametrize(("stages", "heads", "match"), [
    (["s0", "s0"], ["head"], "found it twice"),
    (["s0"], ["s0"], "found it twice"),
    (["../up"], ["head"], "expected 1 to 64 of"),
    ([".."], ["head"], "expected 1 to 64 of"),
    (["a b"], ["head"], "expected 1 to 64 of"),
    (["ca.pem"], ["head"], "expected 1 to 64 of"),
    (["x" * 65], ["head"], "expected 1 to 64 of"),
    ([], ["head"], "at least one stage"),
])
def test_keygen_refuses_bad_node_names(tmp_path: Path, stages: list[str], heads: list[str], match: str) -> None:
    """Duplicate, unsafe or missing node names are refused, and nothing is written."""
    with pytest.raises(CredentialsError, match=match):
        kg.keygen(tmp_path / "keys", stages, heads)
    assert list(tmp_path.iterdir()) == []


def test_keygen_failure_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while signing the second node leaves neither the folder nor a temporary one behind."""
    real, calls = kg._node_certificate, []

    def fail_second(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(kg, "_node_certificate", fail_second)
    with pytest.raises(RuntimeError, match="disk on fire"):
        kg.keygen(tmp_path / "keys", ["s0", "s1"], ["head"])
    assert list(tmp_path.iterdir()) == []


def test_keygen_refuses_a_folder_with_other_files_even_with_force(tmp_path: Path) -> None:
    """A non-empty folder that is no keygen output is never replaced."""
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "notes.txt").write_text("mine")
    with pytest.raises(CredentialsError, match="found other files and no ca.key"):
        kg.keygen(tmp_path / "keys", ["s0"], ["head"], force=True)
    assert (tmp_path / "keys" / "notes.txt").read_text() == "mine"


def test_keygen_without_cryptography_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cryptography package keygen names the extra to install."""
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(OvshardError, match=r"pip install 'ovshard\[secure\]'"):
        kg.keygen(tmp_path / "keys", ["s0"], ["head"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ovshard.cli", "keygen", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_cli_keygen_writes_prints_and_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    """`ovshard keygen` prints a table and a hint, refuses a second run without --force, replaces with it."""
    out = tmp_path / "keys"
    first = _cli("-o", str(out), "--stages", "s0,s1", "--heads", "h0")
    assert first.returncode == 0, first.stderr
    rows = [line.split() for line in first.stdout.splitlines()]
    assert rows == [["node", "role", "folder"], ["s0", "stage", str(out / "s0")],
                    ["s1", "stage", str(out / "s1")], ["h0", "head", str(out / "h0")]]
    assert "--credentials" in first.stderr and "offline" in first.stderr
    ca = (out / "ca.pem").read_bytes()
    again = _cli("-o", str(out), "--stages", "s0")
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert (out / "ca.pem").read_bytes() == ca
    forced = _cli("-o", str(out), "--stages", "s0", "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "ca.pem").read_bytes() != ca
    assert sorted(p.name for p in out.iterdir()) == ["ca.key", "ca.pem", "head", "s0"]


def test_serving_imports_no_cryptography() -> None:
    """The security and keygen modules import without loading cryptography (a node does not need it)."""
    code = "import sys, ovshard.runtime.wire.tls, ovshard.runtime.tools.keygen; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_keygen_files_are_not_world_writable(cluster: Path) -> None:
    """The keygen folder itself is private to its owner (it holds the CA key)."""
    assert stat.S_IMODE(os.stat(cluster).st_mode) == 0o700
