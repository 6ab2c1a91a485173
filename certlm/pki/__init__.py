"""The PKI side: PKI entries and their fields, the HTTP client plumbing of networked PKIs, revocation checks and the CRL
cache, what the open /pki/ca and /pki/crl publish, and the material a push gets from a PKI. Imports the rooms below it.
"""
