"""The store's files as bytes and back: certificates, keys and CRLs in the layout's formats, the trust list's file
names and what makes the trust directories hold a given trust list, and the shell scripts that swap staged files in
(keeping the previous generation) and restore it."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from certlm import TrustList
from certlm_ssh.layout import FileFormat, StoreLayout

STAGING = ".certlm-staging"
PREVIOUS = ".certlm-previous"
# The files certlm writes into the trust directories start with this; others (an operator's trusted clients) stay.
OWN_PREFIX = "certlm-"
_ENCODING = {"DER": serialization.Encoding.DER, "PEM": serialization.Encoding.PEM}


def certificate_bytes(certificate: x509.Certificate, file_format: FileFormat) -> bytes:
    return certificate.public_bytes(_ENCODING[file_format])


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


TrustEntry = x509.Certificate | x509.CertificateRevocationList


def _holds_crls(part: str) -> bool:
    """Whether the ``TrustList`` attribute ``part`` holds CRLs (else certificates)."""
    return part.endswith("crls")


def trust_entries(trust_list: TrustList) -> dict[str, list[TrustEntry]]:
    """The certificates and CRLs of ``trust_list`` by ``TrustList`` attribute; ValueError names the first entry that
    is no DER certificate (or CRL, in the CRL lists)."""
    entries: dict[str, list[TrustEntry]] = {}
    for part in TrustList.MASK_BITS:
        kind = "CRL" if _holds_crls(part) else "certificate"
        loaded: list[TrustEntry] = []
        for index, der in enumerate(getattr(trust_list, part)):
            try:
                loaded.append(x509.load_der_x509_crl(der) if _holds_crls(part) else x509.load_der_x509_certificate(der))
            except (TypeError, ValueError):
                raise ValueError(f"{part}[{index}] is no DER {kind}") from None
        entries[part] = loaded
    return entries


def _file_name(entry: TrustEntry, file_format: FileFormat) -> str:
    """certlm's name for ``entry``'s file: its SHA-1, so that one certificate or CRL is one file."""
    kind = "crl" if isinstance(entry, x509.CertificateRevocationList) else "cert"
    extension = {"cert": {"DER": "der", "PEM": "pem"}, "crl": {"DER": "crl", "PEM": "crl.pem"}}[kind][file_format]
    return f"{OWN_PREFIX}{entry.fingerprint(hashes.SHA1()).hex()}.{extension}"


def _files_of(layout: StoreLayout, entries: Mapping[str, Iterable[TrustEntry]]) -> dict[str, dict[str, bytes]]:
    files: dict[str, dict[str, bytes]] = {}
    for part, directory in layout.trust_directories.items():
        named = files.setdefault(directory, {})
        for entry in entries.get(part, ()):
            named[_file_name(entry, layout.trust_format)] = entry.public_bytes(_ENCODING[layout.trust_format])
    return files


def trust_files(layout: StoreLayout, trust_list: TrustList) -> dict[str, dict[str, bytes]]:
    """The files certlm writes into the trust directories for ``trust_list`` (by layout field, then file name); a
    ValueError names an entry that is no DER certificate or CRL (``trust_entries``)."""
    return _files_of(layout, trust_entries(trust_list))


@dataclass(frozen=True)
class TrustListChanges:
    """What makes the trust directories hold exactly a trust list, by layout field: certlm's files to add (``added``,
    name and content), and the names of the files to remove (``removed``, certlm's or others')."""

    added: dict[str, dict[str, bytes]]
    removed: dict[str, list[str]]

    @property
    def empty(self) -> bool:
        return not any(self.added.values()) and not any(self.removed.values())


def trust_list_changes(
    layout: StoreLayout, held: dict[str, dict[str, bytes]], trust_list: TrustList
) -> TrustListChanges:
    """The changes that make the trust directories, whose files ``held`` gives (by layout field, then name), hold
    exactly ``trust_list``. A file stays when its certificate or CRL is in the list for its directory, whoever put it
    there; so does a file that is no certificate or CRL of its directory (it is no part of the trust list as read).
    Every other file is removed. What the list has that no file of its directory holds is added as certlm's file.
    ValueError as ``trust_entries``."""
    entries = trust_entries(trust_list)
    der = serialization.Encoding.DER
    wanted: dict[str, set[bytes]] = {}
    for part, field in layout.trust_directories.items():
        wanted.setdefault(getattr(layout, field), set()).update(entry.public_bytes(der) for entry in entries[part])
    present: dict[str, set[bytes]] = {}
    removed: dict[str, list[str]] = {}
    for part, field in layout.trust_directories.items():
        directory = getattr(layout, field)
        for name, data in held.get(field, {}).items():
            try:
                content = _der_of(data, crl=_holds_crls(part))
            except ValueError:
                continue
            present.setdefault(directory, set()).add(content)
            if content not in wanted[directory]:
                removed.setdefault(field, []).append(name)
    missing: dict[str, list[TrustEntry]] = {}
    for part, field in layout.trust_directories.items():
        held_there = present.get(getattr(layout, field), set())
        missing[part] = [entry for entry in entries[part] if entry.public_bytes(der) not in held_there]
    return TrustListChanges(added=_files_of(layout, missing), removed=removed)


def _q(path: str) -> str:
    return shlex.quote(path)


def _own_files(layout: StoreLayout) -> list[str]:
    return [
        posixpath.join(layout.own_certs, layout.certificate_file),
        posixpath.join(layout.own_private, layout.private_key_file),
    ]


def _trust_dirs(layout: StoreLayout) -> list[str]:
    return [getattr(layout, field) for field in layout.trust_directories.values()]


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


def _copy_own_files(source: str, target: str, copy: str) -> str:
    """Shell: ``copy`` (move or copy) each of certlm's files in ``source`` into ``target``, replacing the same name."""
    return f'for f in {_q(source)}/{OWN_PREFIX}*; do if [ -f "$f" ]; then {copy} "$f" {_q(target)}/; fi; done'


def _sync_own_files(source: str, target: str, copy: str) -> list[str]:
    """Shell: make certlm's files in ``target`` those of ``source`` (``_copy_own_files``), then remove certlm's files
    ``source`` does not have. Other files of ``target`` are left alone."""
    return [
        f"keep={_names(source)}",
        _copy_own_files(source, target, copy),
        f'for f in {_q(target)}/{OWN_PREFIX}*; do case "$keep" in *" ${{f##*/}} "*) ;; *) rm -f "$f" ;; esac; done',
    ]


def key_directory_mode(key_mode: str) -> int:
    """The mode of an ``own_private`` directory certlm makes: its owner's, and entry (r-x) for the group and others
    exactly where ``key_mode`` lets them read the key (0700 for 0600, 0750 for 0640)."""
    mode = int(key_mode, 8)
    return 0o700 | (0o050 if mode & 0o040 else 0) | (0o005 if mode & 0o004 else 0)


def _new_previous(layout: StoreLayout) -> list[str]:
    """Shell: into the store, with ``PREVIOUS`` emptied for the generation a swap keeps."""
    return ["set -e", "umask 077", f"cd {_q(layout.root)}", f"rm -rf {PREVIOUS}", f"mkdir {PREVIOUS}"]


def _keep_own_files(layout: StoreLayout) -> list[str]:
    """Shell: keep the certificate and the key in ``PREVIOUS`` (those that exist)."""
    lines = []
    for path in _own_files(layout):
        lines.append(f"mkdir -p {_q(posixpath.join(PREVIOUS, posixpath.dirname(path)))}")
        lines.append(f"if [ -e {_q(path)} ]; then cp -p {_q(path)} {_q(posixpath.join(PREVIOUS, path))}; fi")
    return lines


def _keep_trust_files(layout: StoreLayout, removed: Mapping[str, Iterable[str]]) -> list[str]:
    """Shell: make the trust directories that are missing (0755), and keep in ``PREVIOUS`` certlm's files of each and
    the others' files the swap removes (``removed``, names by layout field), so that ``restore_script`` puts them
    back."""
    lines = []
    for field in layout.trust_directories.values():
        directory = getattr(layout, field)
        kept = posixpath.join(PREVIOUS, directory)
        lines.append(f"if [ ! -d {_q(directory)} ]; then (umask 022 && mkdir -p {_q(directory)}); fi")
        lines.append(f"mkdir -p {_q(kept)}")
        lines.append(f'for f in {_q(directory)}/{OWN_PREFIX}*; do if [ -f "$f" ]; then cp -p "$f" {_q(kept)}; fi; done')
        for name in removed.get(field, ()):
            if not name.startswith(OWN_PREFIX):
                lines.append(f"cp -Pp {_q(posixpath.join(directory, name))} {_q(kept)}/")
    return lines


def _writable(directories: Iterable[str]) -> list[str]:
    """Shell: stop, before anything changed, when the SSH user cannot write one of ``directories``."""
    return [
        f'[ -w {_q(directory)} ] || {{ echo "{directory} is not writable by the SSH user" >&2; exit 1; }}'
        for directory in sorted(set(directories))
    ]


def install_script(layout: StoreLayout) -> str:
    """Swap the staged files in, keeping the previous generation in ``PREVIOUS`` first: the certificate, the key and
    certlm's own files of the trust directories. The trust directories are updated in place, so they keep the modes
    and owners they have and the files certlm did not write; directories that are missing are made (0755; the key's
    own as ``key_directory_mode`` says, given to ``key_owner``). Every directory is checked writable before anything
    changes. The key gets its owner and mode before it takes its name; each file takes its place by a rename."""
    key = posixpath.join(layout.own_private, layout.private_key_file)
    lines = _new_previous(layout)
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
    lines += _keep_own_files(layout) + _keep_trust_files(layout, {})
    lines += _writable([posixpath.dirname(p) for p in _own_files(layout)] + _trust_dirs(layout))
    lines.append(f"touch {PREVIOUS}/complete")
    for path in _own_files(layout):
        lines.append(f"mv -f {_q(posixpath.join(STAGING, path))} {_q(path)}")
    for directory in _trust_dirs(layout):
        lines += _sync_own_files(posixpath.join(STAGING, directory), directory, "mv -f")
    lines.append(f"rm -rf {STAGING}")
    return "\n".join(lines) + "\n"


def trust_list_script(layout: StoreLayout, removed: Mapping[str, Iterable[str]]) -> str:
    """Swap a staged trust list in (``TrustListChanges``): keep the previous generation in ``PREVIOUS`` first, as
    ``install_script`` does, with the others' files this removes; check the trust directories writable; remove the
    files ``removed`` names (by layout field), then rename certlm's staged files into place. The certificate and key
    stay as they are, and so do the trust directories' modes and owners."""
    lines = _new_previous(layout) + _keep_own_files(layout) + _keep_trust_files(layout, removed)
    lines += _writable(_trust_dirs(layout))
    lines.append(f"touch {PREVIOUS}/complete")
    for field, names in removed.items():
        lines += [f"rm -f {_q(posixpath.join(getattr(layout, field), name))}" for name in names]
    for directory in _trust_dirs(layout):
        lines.append(_copy_own_files(posixpath.join(STAGING, directory), directory, "mv -f"))
    lines.append(f"rm -rf {STAGING}")
    return "\n".join(lines) + "\n"


RESTORED = "restored"
NOTHING_SWAPPED = "nothing swapped"


def _put_back_missing(kept: str, directory: str) -> str:
    """Shell: copy back each file of ``kept`` (a trust directory's in ``PREVIOUS``) that ``directory`` lacks: the
    others' files a trust list write removed."""
    every = " ".join(f"{_q(kept)}/{pattern}" for pattern in ("*", ".[!.]*", "..?*"))
    gone = f'[ ! -e {_q(directory)}/"${{f##*/}}" ] && [ ! -L {_q(directory)}/"${{f##*/}}" ]'
    there = '{ [ -e "$f" ] || [ -L "$f" ]; }'
    return f'for f in {every}; do if {there} && {gone}; then cp -Pp "$f" {_q(directory)}/; fi; done'


def restore_script(layout: StoreLayout) -> str:
    """Put the generation a swap (``install_script``, ``trust_list_script``) kept back in place and keep it in
    ``PREVIOUS`` (the last good one): the certificate and key (a file that did not exist before is removed), certlm's
    files of the trust directories, and the others' files a trust list write removed. Prints ``RESTORED``, or
    ``NOTHING_SWAPPED`` when the swap stopped before it changed the store."""
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
        kept = posixpath.join(PREVIOUS, directory)
        lines += _sync_own_files(kept, directory, "cp -p")
        lines.append(_put_back_missing(kept, directory))
    lines.append(f"rm -rf {STAGING}")
    lines.append(f'echo "{RESTORED}"')
    return "\n".join(lines) + "\n"


def staged_path(layout: StoreLayout, directory: str, name: str) -> str:
    """Where ``name`` of the store ``directory`` (a layout field) is staged before a swap."""
    return posixpath.join(layout.root, STAGING, getattr(layout, directory), name)
