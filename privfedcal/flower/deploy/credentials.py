"""Credentials of an authenticated Flower deployment: TLS certificates and SuperNode keys.

Flower 1.41 secures a deployment with two independent mechanisms (docs/flower.md,
"Authenticated deployment"):

* **TLS** on the SuperLink's port (Fleet, Control and ServerApp runtime APIs): the SuperLink
  presents a certificate signed by a CA; SuperNodes (``--root-certificates``) and ``flwr``
  (``root-certificates`` in its connection) verify it against that CA. The certificate must
  name the address the others dial (a DNS name or IP address in its subjectAltName).
* **SuperNode authentication** (``flower-superlink --enable-supernode-auth``): a SuperNode
  signs its requests with an EC private key (OpenSSH format, a NIST curve); the SuperLink
  only accepts nodes whose public key was registered with ``flwr supernode register``.

``python -m privfedcal.flower.deploy.credentials ca DIR --name HOST ...`` writes ``ca.crt``,
``ca.key`` (keep it offline: it signs certificates), ``server.pem`` and ``server.key`` (the
SuperLink's); ``python -m privfedcal.flower.deploy.credentials node-key DIR/NAME`` writes the
SuperNode key pair ``NAME`` (private, stays on the node) and ``NAME.pub`` (what the
operator registers). Private keys are written with mode 0600. The same files can be made
with ``openssl`` and ``ssh-keygen -t ecdsa -b 384`` (docs/flower.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def _write_private(path: Path, data: bytes) -> None:
    """``data`` to ``path`` readable by its owner only (created so, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_tls(folder: Path, names: list[str], days: int = VALID_DAYS) -> dict[str, Path]:
    """A CA and a SuperLink certificate for ``names`` (its DNS names / IP addresses) signed
    by it, in ``folder``: ``ca.crt``, ``ca.key``, ``server.pem``, ``server.key``."""
    if not names:
        raise ValueError("the SuperLink certificate needs at least one name or address")
    folder = Path(folder)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "privfedcal federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
              .issuer_name(ca_name).public_key(key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5))
              .not_valid_after(now + dt.timedelta(days=days))
              .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                             critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                  ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"ca_cert": folder / "ca.crt", "ca_key": folder / "ca.key",
             "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca_cert"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_private(paths["ca_key"], _pem_key(ca_key))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_private(paths["key"], _pem_key(key))
    return paths


def make_node_key(path: Path) -> tuple[Path, Path]:
    """A SuperNode's EC (P-384) key pair in OpenSSH format: ``path`` (private, 0600) and
    ``path.pub`` (public: what ``flwr supernode register`` takes)."""
    path = Path(path)
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    public = path.with_name(path.name + ".pub")
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH)
                       + f" {path.name}\n".encode())
    return path, public


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m privfedcal.flower.deploy.credentials",
                                 description="TLS certificates and SuperNode keys for an "
                                 "authenticated Flower deployment (docs/flower.md)")
    sub = ap.add_subparsers(dest="what", required=True)
    ca = sub.add_parser("ca", help="a CA and the SuperLink's certificate")
    ca.add_argument("folder", type=Path)
    ca.add_argument("--name", action="append", required=True,
                    help="a DNS name or IP address SuperNodes and flwr dial (repeatable)")
    ca.add_argument("--days", type=int, default=VALID_DAYS)
    node = sub.add_parser("node-key", help="a SuperNode's key pair (PATH and PATH.pub)")
    node.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    if args.what == "ca":
        for p in make_tls(args.folder, args.name, args.days).values():
            print(p)
    else:
        for p in make_node_key(args.path):
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
