"""The store's files as bytes and back: certificates, keys and CRLs in the layout's formats, the trust list's file
names, and the shell scripts that swap staged files in (keeping the previous generation) and restore it."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from certlm import TrustList, sha1_fingerprint
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
    """Make the store's root when it is missing (0755), and an empty staging tree private to the SSH user with the
    store's directories."""
    staging = posixpath.join(layout.root, STAGING)
    directories = sorted({posixpath.dirname(p) for p in _own_files(layout)} | set(_trust_dirs(layout)))
    return " && ".join(
        [
            f"(umask 022 && mkdir -p {_q(layout.root)})",
            f"rm -rf {_q(staging)}",
            f"(umask 077 && mkdir -p {' '.join(_q(posixpath.join(staging, d)) for d in directories)})",
        ]
    )


def _names(directory: str) -> str:
    """Shell: the names of certlm's files in ``directory``, space-separated and space-framed (`` a b ``)."""
    return f'" $(cd {_q(directory)} && for f in {OWN_PREFIX}*; do if [ -e "$f" ]; then printf "%s " "$f"; fi; done) "'


def _sync_own_files(source: str, target: str, copy: str) -> list[str]:
    """Shell: make certlm's files in ``target`` those of ``source`` (``copy`` moves or copies each in, replacing the
    same name), then remove certlm's files ``source`` does not have. Other files of ``target`` are left alone."""
    return [
        f"keep={_names(source)}",
        f'for f in {_q(source)}/{OWN_PREFIX}*; do if [ -f "$f" ]; then {copy} "$f" {_q(target)}/; fi; done',
        f'for f in {_q(target)}/{OWN_PREFIX}*; do case "$keep" in *" ${{f##*/}} "*) ;; *) rm -f "$f" ;; esac; done',
    ]


def key_directory_mode(key_mode: str) -> int:
    """The mode of an ``own_private`` directory certlm makes: its owner's, and entry (r-x) for the group and others
    exactly where ``key_mode`` lets them read the key (0700 for 0600, 0750 for 0640)."""
    mode = int(key_mode, 8)
    return 0o700 | (0o050 if mode & 0o040 else 0) | (0o005 if mode & 0o004 else 0)


def install_script(layout: StoreLayout) -> str:
    """Swap the staged files in, keeping the previous generation in ``PREVIOUS`` first: the certificate, the key and
    certlm's own files of the trust directories. The trust directories are updated in place, so they keep the modes
    and owners they have and the files certlm did not write; directories that are missing are made (0755; the key's
    own as ``key_directory_mode`` says, given to ``key_owner``). Every directory is checked writable before anything
    changes. The key gets its owner and mode before it takes its name; each file takes its place by a rename."""
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
    for path in _own_files(layout):
        directory = posixpath.dirname(path)
        made = f"(umask 022 && mkdir -p {_q(directory)})"
        if directory == layout.own_private and layout.own_private != layout.own_certs:
            made += f" && chmod {key_directory_mode(layout.key_mode):03o} {_q(directory)}"
            if layout.key_owner:
                made += f" && chown {_q(layout.key_owner)} {_q(directory)}"
        lines.append(f"if [ ! -d {_q(directory)} ]; then {made}; fi")
        lines.append(f"mkdir -p {_q(posixpath.join(PREVIOUS, directory))}")
        lines.append(f"if [ -e {_q(path)} ]; then cp -p {_q(path)} {_q(posixpath.join(PREVIOUS, path))}; fi")
    for directory in _trust_dirs(layout):
        kept = posixpath.join(PREVIOUS, directory)
        lines.append(f"if [ ! -d {_q(directory)} ]; then (umask 022 && mkdir -p {_q(directory)}); fi")
        lines.append(f"mkdir -p {_q(kept)}")
        lines.append(f'for f in {_q(directory)}/{OWN_PREFIX}*; do if [ -f "$f" ]; then cp -p "$f" {_q(kept)}; fi; done')
    for directory in sorted({posixpath.dirname(p) for p in _own_files(layout)} | set(_trust_dirs(layout))):
        lines.append(f'[ -w {_q(directory)} ] || {{ echo "{directory} is not writable by the SSH user" >&2; exit 1; }}')
    lines.append(f"touch {PREVIOUS}/complete")
    for path in _own_files(layout):
        lines.append(f"mv -f {_q(posixpath.join(STAGING, path))} {_q(path)}")
    for directory in _trust_dirs(layout):
        lines += _sync_own_files(posixpath.join(STAGING, directory), directory, "mv -f")
    lines.append(f"rm -rf {STAGING}")
    return "\n".join(lines) + "\n"


RESTORED = "restored"
NOTHING_SWAPPED = "nothing swapped"


def restore_script(layout: StoreLayout) -> str:
    """Put the generation ``install_script`` kept back in place and keep it in ``PREVIOUS`` (the last good one): the
    certificate and key (a file that did not exist before is removed), certlm's files of the trust directories.
    Prints ``RESTORED``, or ``NOTHING_SWAPPED`` when the install stopped before it changed the store."""
    lines = [
        "set -e",
        "umask 077",
        f"cd {_q(layout.root)}",
        f'if [ ! -e {PREVIOUS}/complete ]; then rm -rf {STAGING}; echo "{NOTHING_SWAPPED}"; exit 0; fi',
    ]
    for path in _own_files(layout):
        kept, restoring = posixpath.join(PREVIOUS, path), f"{path}.certlm-restoring"
        lines.append(
            f"if [ -e {_q(kept)} ]; then cp -p {_q(kept)} {_q(restoring)} && mv -f {_q(restoring)} {_q(path)}; "
            f"else rm -f {_q(path)}; fi"
        )
    for directory in _trust_dirs(layout):
        lines += _sync_own_files(posixpath.join(PREVIOUS, directory), directory, "cp -p")
    lines.append(f"rm -rf {STAGING}")
    lines.append(f'echo "{RESTORED}"')
    return "\n".join(lines) + "\n"
