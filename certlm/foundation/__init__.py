"""What every room uses and that knows nothing of devices or PKIs: errors, settings, the encryption of
secrets, certificate helpers, CRL status codes, device addresses, logging, the loop watchdog, shared request and
response shapes. Imports no other room.
"""
