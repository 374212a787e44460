"""Credentials for a local control plane: a CA, the API server's serving certificate, the
service-account signing key pair, static bearer tokens and kubeconfig files.

All material is generated fresh per cluster into its state directory; nothing is committed.
"""
from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class ClusterCredentials:
    """Paths of the generated files plus the admin bearer token (a ``system:masters`` user)."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_public_key: Path
    sa_signing_key: Path
    token_file: Path
    admin_token: str


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _cert(subject: str, key, issuer_key, issuer_name: x509.Name | None, *, ca: bool,
          sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_name or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=7))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def generate(directory: Path, service_ip: str = "10.0.0.1",
             extra_ips: tuple[str, ...] = ()) -> ClusterCredentials:
    """Write CA, serving cert (localhost, 127.0.0.1, ``extra_ips``, the kubernetes Service IP
    and names), service-account keys and a token CSV into ``directory``; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("shardline-local-ca", ca_key, ca_key, None, ca=True)
    serving_key = _key()
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"), x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"), x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
    ]
    serving = _cert("kube-apiserver", serving_key, ca_key, ca.subject, ca=False, sans=sans)
    sa_key = _key()
    creds = ClusterCredentials(
        ca_cert=directory / "ca.crt", serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key", sa_public_key=directory / "sa.pub",
        sa_signing_key=directory / "sa.key", token_file=directory / "tokens.csv",
        admin_token=secrets.token_hex(24))
    creds.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    creds.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(creds.serving_key, serving_key)
    _write_key(creds.sa_signing_key, sa_key)
    creds.sa_public_key.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    # token,user,uid,"group1,group2"
    creds.token_file.write_text(f'{creds.admin_token},shardline-admin,shardline-admin,'
                                f'"system:masters"\n')
    creds.token_file.chmod(0o600)
    return creds


def write_kubeconfig(path: Path, server: str, ca_cert: Path, token: str,
                     user: str = "admin", namespace: str = "default") -> Path:
    """Write a kubeconfig with one cluster/user/context ("local") using a bearer token."""
    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "local", "cluster": {"server": server,
                                                   "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user,
                                                   "namespace": namespace}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
