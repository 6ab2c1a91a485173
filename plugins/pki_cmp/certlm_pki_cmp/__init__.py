"""certlm PKI type 3: a CMP (RFC 4210, lightweight profile RFC 9483) client."""
