"""License signing keys made for a test, and licenses they sign: the certlm a test starts trusts the public key."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

from certlm.system.licensing import generate_key_pair, issue_license, load_private_key


@dataclass
class LicenseKeys:
    """An Ed25519 key pair standing in for the vendor's license key: a certlm started with ``public_key_file`` as
    its ``CERTLM_LICENSE_PUBLIC_KEY_FILE`` accepts the licenses ``issue`` signs."""

    private_key_file: Path
    public_key_file: Path

    @classmethod
    def create(cls, directory: Path) -> LicenseKeys:
        """A new key pair in ``directory`` (made if missing)."""
        directory.mkdir(parents=True, exist_ok=True)
        private_path, public_path = generate_key_pair(directory)
        return cls(private_path, public_path)

    @classmethod
    def create_other(cls) -> LicenseKeys:
        """A key pair no certlm of the test trusts, in a directory of its own: its licenses are refused."""
        return cls.create(Path(tempfile.mkdtemp(prefix="other-license-keys-")))

    def issue(
        self,
        *,
        features: tuple[str, ...] = ("core",),
        endpoints: int = 1000,
        start: date | None = None,
        end: date | None = None,
        company: str = "Test Plant GmbH",
        license_type: str = "commercial",
    ) -> str:
        """A license (base64) signed with this key pair, valid from yesterday for a year unless ``start``/``end``
        say otherwise."""
        today = date.today()
        return issue_license(
            load_private_key(self.private_key_file),
            company=company,
            features=list(features),
            licensed_endpoints=endpoints,
            validity_start=start or today - timedelta(days=1),
            validity_end=end or today + timedelta(days=365),
            license_type=license_type,
        )
