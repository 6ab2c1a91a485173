"""The store's files as bytes and back: certificates, keys and CRLs in the layout's formats, the trust list's file
names, and the shell scripts that swap staged files in (keeping the previous ones) and restore them."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from certlm.certs import sha1_fingerprint
from certlm.drivers import TrustList
from certlm_ssh.layout import FileFormat, StoreLayout

STAGING = ".certlm-staging"
PREVIOUS = ".certlm-previous"
# The files certlm writes into the trust directories start with this; others (an operator's trusted clients) stay.
OWN_PREFIX = "certlm-"
_ENCODING = {"DER": serialization.Encoding.DER, "PEM": serialization.Encoding.PEM}


def certificate_bytes(certificate: x509.Certificate, file_format: FileFormat) -> bytes:
    return certificate.public_bytes(_ENCODING[file_format])


def crl_bytes(crl: x509.CertificateRevocationList, file_format: FileFormat) -> bytes:
    return crl.public_bytes(_ENCODING[file_format])


def private_key_bytes(key: PrivateKeyTypes, file_format: FileFormat) -> bytes:
    return key.private_bytes(_ENCODING[file_format], serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def load_certificate_file(data: bytes) -> x509.Certificate:
    if data.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(data)
    return x509.load_der_x509_certificate(data)


def _der_of(data: bytes, crl: bool) -> bytes:
    """A certificate or CRL file (PEM or DER) as DER; what cannot be parsed is left out by the caller."""
    if crl:
        loaded = (
            x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----BEGIN") else x509.load_der_x509_crl(data)
        )
        return loaded.public_bytes(serialization.Encoding.DER)
    return load_certificate_file(data).public_bytes(serialization.Encoding.DER)


def trust_list_of(files: dict[str, dict[str, bytes]], layout: StoreLayout, mask: int = TrustList.ALL) -> TrustList:
    """The trust list the four directories' ``files`` hold (by ``TrustList`` attribute, then file name), as DER;
    files that are no certificate or CRL are skipped."""
    trust_list = TrustList()
    for part, bit in TrustList.MASK_BITS.items():
        if not mask & bit:
            continue
        for data in files.get(part, {}).values():
            try:
                getattr(trust_list, part).append(_der_of(data, crl=part.endswith("crls")))
            except ValueError:
                continue
    return trust_list


def _file_name(kind: str, identifier: str, file_format: FileFormat) -> str:
    extension = {"cert": {"DER": "der", "PEM": "pem"}, "crl": {"DER": "crl", "PEM": "crl.pem"}}[kind][file_format]
    return f"{OWN_PREFIX}{identifier}.{extension}"


def trust_files(
    layout: StoreLayout,
    trusted: Iterable[x509.Certificate],
    trusted_crls: Iterable[x509.CertificateRevocationList],
    issuers: Iterable[x509.Certificate],
    issuer_crls: Iterable[x509.CertificateRevocationList],
) -> dict[str, dict[str, bytes]]:
    """The files certlm puts in each trust directory (by layout field), named by fingerprint."""

    def certificates(items: Iterable[x509.Certificate]) -> dict[str, bytes]:
        return {
            _file_name("cert", sha1_fingerprint(c).replace(":", "").lower(), layout.trust_format): certificate_bytes(
                c, layout.trust_format
            )
            for c in items
        }

    def crls(items: Iterable[x509.CertificateRevocationList]) -> dict[str, bytes]:
        named = {}
        for crl in items:
            identifier = crl.fingerprint(hashes.SHA1()).hex()
            named[_file_name("crl", identifier, layout.trust_format)] = crl_bytes(crl, layout.trust_format)
        return named

    return {
        "trusted_certs": certificates(trusted),
        "trusted_crl": crls(trusted_crls),
        "issuer_certs": certificates(issuers),
        "issuer_crl": crls(issuer_crls),
    }


def _q(path: str) -> str:
    return shlex.quote(path)


def _own_files(layout: StoreLayout) -> list[str]:
    return [
        posixpath.join(layout.own_certs, layout.certificate_file),
        posixpath.join(layout.own_private, layout.private_key_file),
    ]


def _trust_dirs(layout: StoreLayout) -> list[str]:
    return [layout.trusted_certs, layout.trusted_crl, layout.issuer_certs, layout.issuer_crl]


def staging_script(layout: StoreLayout) -> str:
    """Make an empty staging tree (private) with the store's directories."""
    staging = posixpath.join(layout.root, STAGING)
    directories = sorted({posixpath.dirname(p) for p in _own_files(layout)} | set(_trust_dirs(layout)))
    return " && ".join(
        [
            f"umask 077 && mkdir -p {_q(layout.root)}",
            f"rm -rf {_q(staging)}",
            *(f"mkdir -p {_q(posixpath.join(staging, d))}" for d in directories),
        ]
    )


def install_script(layout: StoreLayout) -> str:
    """Swap the staged files in: the previous certificate, key and trust directories are kept in ``PREVIOUS`` first;
    files of the trust directories that certlm did not write are carried over. The key gets its owner and mode before
    it takes its name. Each file and directory takes its place by a rename."""
    key = posixpath.join(layout.own_private, layout.private_key_file)
    lines = [
        "set -e",
        "umask 077",
        f"cd {_q(layout.root)}",
        f"rm -rf {PREVIOUS}",
        f"mkdir {PREVIOUS}",
    ]
    if layout.key_owner:
        lines.append(f"chown {_q(layout.key_owner)} {_q(posixpath.join(STAGING, key))}")
    lines.append(f"chmod {layout.key_mode} {_q(posixpath.join(STAGING, key))}")
    for directory in _trust_dirs(layout):
        staged = posixpath.join(STAGING, directory)
        lines.append(
            f'if [ -d {_q(directory)} ]; then for f in {_q(directory)}/*; do case "${{f##*/}}" in {OWN_PREFIX}*) ;; '
            f'*) if [ -f "$f" ]; then cp -p "$f" {_q(staged)}/; fi ;; esac; done; fi'
        )
    for path in _own_files(layout):
        lines.append(f"mkdir -p {_q(posixpath.dirname(path))} {_q(posixpath.join(PREVIOUS, posixpath.dirname(path)))}")
        lines.append(f"if [ -e {_q(path)} ]; then cp -p {_q(path)} {_q(posixpath.join(PREVIOUS, path))}; fi")
    for directory in _trust_dirs(layout):
        parent = posixpath.dirname(directory) or "."
        kept = posixpath.join(PREVIOUS, directory)
        lines.append(f"mkdir -p {_q(parent)} {_q(posixpath.join(PREVIOUS, parent))}")
        lines.append(f"if [ -d {_q(directory)} ]; then mv {_q(directory)} {_q(kept)}; fi")
        lines.append(f"mv {_q(posixpath.join(STAGING, directory))} {_q(directory)}")
    lines.append(f"touch {PREVIOUS}/complete")
    for path in _own_files(layout):
        lines.append(f"mv -f {_q(posixpath.join(STAGING, path))} {_q(path)}")
    lines.append(f"rm -rf {STAGING}")
    return "\n".join(lines) + "\n"


def restore_script(layout: StoreLayout) -> str:
    """Put the files ``install_script`` kept back in place (a file or directory that did not exist before is
    removed)."""
    lines = ["set -e", f"cd {_q(layout.root)}", f"[ -e {PREVIOUS}/complete ]"]
    for path in _own_files(layout):
        kept = posixpath.join(PREVIOUS, path)
        lines.append(f"if [ -e {_q(kept)} ]; then mv -f {_q(kept)} {_q(path)}; else rm -f {_q(path)}; fi")
    for directory in _trust_dirs(layout):
        kept = posixpath.join(PREVIOUS, directory)
        lines.append(f"rm -rf {_q(directory)}")
        lines.append(f"if [ -d {_q(kept)} ]; then mv {_q(kept)} {_q(directory)}; fi")
    lines.append(f"rm -rf {PREVIOUS} {STAGING}")
    return "\n".join(lines) + "\n"
