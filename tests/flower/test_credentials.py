"""The credentials of an authenticated deployment are what Flower 1.41 loads, and private."""

from __future__ import annotations

import ipaddress
import ssl

import pytest

pytest.importorskip("flwr")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.serialization import load_ssh_private_key  # noqa: E402

from privfedcal.flower.deploy.credentials import main, make_node_key, make_tls  # noqa: E402


def test_server_certificate_is_signed_by_the_ca_for_the_names_given(tmp_path):
    paths = make_tls(tmp_path / "tls", ["127.0.0.1", "link.example.org"])
    ca = x509.load_pem_x509_certificate(paths["ca_cert"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)  # raises unless ca signed it
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["link.example.org"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # Python's TLS server (the SuperLink's) loads the pair; private keys are 0600
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(paths["cert"],
                                                                        paths["key"])
    for key in (paths["key"], paths["ca_key"]):
        assert key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="at least one name"):
        make_tls(tmp_path / "none", [])


def test_node_key_is_what_flower_loads(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key

    private, public = make_node_key(tmp_path / "keys" / "supernode-0")
    assert private.stat().st_mode & 0o777 == 0o600
    key = load_ssh_private_key(private.read_bytes(), None)  # as flower-supernode does
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert try_load_public_key(public)  # as `flwr supernode register` does
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_cli_writes_both(tmp_path, capsys):
    assert main(["ca", str(tmp_path / "tls"), "--name", "localhost"]) == 0
    assert main(["node-key", str(tmp_path / "k")]) == 0
    printed = capsys.readouterr().out.split()
    assert {p.rsplit("/", 1)[-1] for p in printed} == {"ca.crt", "ca.key", "server.pem",
                                                      "server.key", "k", "k.pub"}
