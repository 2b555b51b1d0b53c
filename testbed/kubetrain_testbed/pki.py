"""The testbed's certificates and keys, made with the openssl CLI.

A real API server needs TLS, a client CA for its admin and for the controllers'
identities (RBAC is on), and a key pair for signing ServiceAccount tokens. The
openssl CLI is on every Debian machine, so no Python crypto package is needed.
Keys are ECDSA P-256 (fast to make); the ServiceAccount key is RSA, the
algorithm every Kubernetes client verifies.
"""

from __future__ import annotations

import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVICE_IP = "10.96.0.1"
"""First address of the service range: the in-cluster `kubernetes` Service."""

_API_SANS = (
    "IP:127.0.0.1",
    f"IP:{SERVICE_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate: the API server reads CN as user, O as group."""

    name: str
    """File stem in the pki folder."""
    user: str
    group: str = ""


#: Identities the testbed's own components and tests use.
IDENTITIES = (
    ClientIdentity(name="admin", user="kubetrain-testbed-admin", group="system:masters"),
    ClientIdentity(name="kube-controller-manager", user="system:kube-controller-manager"),
    ClientIdentity(name="kube-scheduler", user="system:kube-scheduler"),
)


@dataclass(frozen=True)
class Pki:
    """Paths of everything in the pki folder."""

    root: Path

    @property
    def ca_crt(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    def crt(self, name: str) -> Path:
        return self.root / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def complete(self) -> bool:
        names = ["apiserver", *(i.name for i in IDENTITIES)]
        files = [self.ca_crt, self.ca_key, self.sa_key, self.sa_pub]
        files += [p for n in names for p in (self.crt(n), self.key(n))]
        return all(f.is_file() and f.stat().st_size > 0 for f in files)


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()[-2000:]}")


def _ec_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def _sign(pki: Pki, name: str, subject: str, extensions: str) -> None:
    _ec_key(pki.key(name))
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        ext.write_text(extensions)
        _openssl("req", "-new", "-key", str(pki.key(name)), "-subj", subject, "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
            "-set_serial", str(secrets.randbits(63)), "-days", "3650", "-sha256",
            "-extfile", str(ext), "-out", str(pki.crt(name)),
        )  # fmt: skip


def ensure_client(pki: Pki, ident: ClientIdentity) -> None:
    """A client certificate signed by the existing CA, made once (an optional component's identity:
    adding one never re-creates the CA that a running testbed trusts)."""
    if _issued_by_current_ca(pki, ident.name):
        return
    subject = (f"/O={ident.group}" if ident.group else "") + f"/CN={ident.user}"
    _sign(pki, ident.name, subject, _CLIENT_EXT)


def ensure_serving(pki: Pki, name: str, sans: tuple[str, ...] = ("IP:127.0.0.1", "DNS:localhost")) -> None:
    """A serving certificate for `sans` signed by the testbed CA (a component's webhook server), made once."""
    if _issued_by_current_ca(pki, name):
        return
    _sign(pki, name, f"/CN={name}", _server_ext(sans))


def _issued_by_current_ca(pki: Pki, name: str) -> bool:
    """Made after the CA (ensure_pki re-creates the CA and its own files, not these)."""
    crt, key = pki.crt(name), pki.key(name)
    return crt.is_file() and key.is_file() and crt.stat().st_mtime >= pki.ca_crt.stat().st_mtime


_CLIENT_EXT = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"


def _server_ext(sans: tuple[str, ...]) -> str:
    return ("basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            f"subjectAltName={','.join(sans)}\n")


def ensure_pki(root: Path) -> Pki:
    """Create the CA, serving, client and ServiceAccount keys unless all exist."""
    pki = Pki(root)
    if pki.complete():
        return pki
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    _ec_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-subj", "/CN=kubetrain-testbed-ca",
        "-days", "3650", "-sha256", "-out", str(pki.ca_crt),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )  # fmt: skip
    _sign(pki, "apiserver", "/CN=kube-apiserver", _server_ext(_API_SANS))
    for ident in IDENTITIES:
        subject = (f"/O={ident.group}" if ident.group else "") + f"/CN={ident.user}"
        _sign(pki, ident.name, subject, _CLIENT_EXT)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki.sa_key))
    pki.sa_key.chmod(0o600)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    return pki
