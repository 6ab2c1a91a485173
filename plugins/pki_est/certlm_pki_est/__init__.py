"""certlm PKI type 2: an EST (RFC 7030) client."""
