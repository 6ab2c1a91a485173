"""Simulated OPC UA devices (PLCs) with Part 12 push certificate management, for tests, demos and benchmarks.

The simulator is asyncua and cryptography only, no certlm: certlm's side is ``driver`` (the simulated PLC's
GDS push driver, service ``gds-push-certlm-simulated-plc``) and ``plugin`` (its ``certlm`` entry point), which
importing this package does not load.

Python API, inside a running event loop::

    from certlm_opcua_simulator import SimulatorConfig, SimulatedDevice, run_devices

    config = SimulatorConfig(state_dir=Path("state"), port=48500)  # all fields: see SimulatorConfig
    async with SimulatedDevice(config) as device:  # or: await device.start() ... await device.stop()
        device.url              # "opc.tcp://127.0.0.1:48500"
        device.application_uri  # "urn:certlm:simulator:simulated-plc:48500"
        device.certificate      # the x509.Certificate applied last (presented once the endpoints reopened)
        device.trust_list       # TrustList: trusted_certificates, trusted_crls, issuer_certificates, issuer_crls
        device.rejected         # refused client certificates (DER), as GetRejectedList returns them
        device.listening        # False while down after an injected drop
        await device.settle()   # until the endpoints reopened after applied changes or a drop with down_s
    async with run_devices(config, count=3) as devices:  # ports 48500..48502, started concurrently
        ...

Command line: ``certlm-simulate --count N --port P --state-dir DIR [...]`` (see ``--help``) prints
``READY opc.tcp://127.0.0.1:PORT`` per device once all listen, and stops cleanly on SIGTERM or SIGINT. A device
whose state folder exists starts from it, so ``--trust-client-cert`` is then ignored, which stderr says.

Nodes a device driver can read, by BrowseName (namespaces by URI, not index):

- ``Objects/DeviceSet`` (``http://opcfoundation.org/UA/DI/``; NodeId i=5001 in that namespace) holds one
  device object (``urn:certlm:simulator``; named after the product, ``SimulatedPLC`` by default) with String
  properties in the DI namespace: ``Manufacturer``, ``Model`` (the product), ``SerialNumber``
  (``SIM-<port>``), ``SoftwareRevision`` (the firmware), ``HardwareRevision``, ``DeviceRevision``,
  ``ProductCode``.
- ``Objects/PLC`` (``urn:certlm:simulator``) with ``OperatingMode`` (String, ``run`` or ``stop``),
  ``ProgramName`` (String) and ``CycleTimeMs`` (Double), all in ``urn:certlm:simulator``.
- ``Server/ServerStatus/BuildInfo``: ``ManufacturerName``, ``ProductName``, ``SoftwareVersion``.

Push certificate management (Part 12; 1.05 where versions differ), on the DefaultApplicationGroup with
RsaSha256ApplicationCertificateType (a null group or type NodeId means these):

- Every ServerConfiguration and TrustList method needs a SignAndEncrypt channel (else
  BadSecurityModeInsufficient) and an ``admin`` user (else BadUserAccessDenied). Arguments of the wrong
  number or type give BadArgumentsMissing, BadTooManyArguments or BadInvalidArgument.
- UpdateCertificate and opening the TrustList for writing start a transaction of the calling session
  (applyChangesRequired True, unless a switch below applies them at once); other sessions get
  BadTransactionPending, and BadSessionIdInvalid for ApplyChanges/CancelChanges. ApplyChanges without a
  transaction gives BadNothingToDo, with the TrustList still open for writing BadInvalidState. CancelChanges,
  closing the session, or an injected drop discard it. After ApplyChanges the device answers, waits
  ``apply_delay_s``, drops every channel and listens again.
- Order: by default the device is as strict as real ones get, so a push client must update the trust list
  before the certificate (Part 12 7.7). While a certificate update is pending (in any session's transaction),
  Open and OpenWithMasks answer BadTransactionPending, for reading too. UpdateCertificate refuses a CA-issued
  certificate whose chain does not end, through the given issuer certificates and those of the trust list the
  caller would have after ApplyChanges (its pending one, else the applied one), in a trusted certificate or a
  self-signed root held as trusted or issuer certificate (BadCertificateChainIncomplete); that trust list must
  hold a CRL of each CA of the chain (else BadCertificateRevocationUnknown for the issuing CA,
  BadCertificateIssuerRevocationUnknown for one above it), not revoking the certificate below it
  (BadCertificateRevoked, BadCertificateIssuerRevoked); its CAs must be valid now
  (BadCertificateIssuerTimeInvalid). A self-signed certificate needs none of this. ``lenient=True`` accepts
  either order and needs no CRL.
- ``trust_list_applies_at_once=True``: opening the TrustList for writing starts no transaction, and
  CloseAndUpdate applies (persists, publishes) the list at once and answers applyChangesRequired False.
  ``certificate_applies_at_once=True``: UpdateCertificate applies the certificate at once, answers False, and
  the endpoints reopen with it ``apply_delay_s`` later; when the caller's transaction still holds a trust list,
  they reopen when that transaction ends (ApplyChanges, CancelChanges, the session closing), so that the
  session lives to apply it. With both, ApplyChanges has nothing to do (BadNothingToDo).
- CreateSigningRequest: subject ``CN=a/O=b`` (Part 12) or ``CN=a,O=b`` (RFC 4514), empty keeps the current
  one; regeneratePrivateKey needs a nonce of 32+ bytes; BadNotSupported when ``can_create_csr`` is False;
  ``fixed_key`` keeps the current key whatever regeneratePrivateKey says.
- UpdateCertificate also refuses, whatever ``lenient`` says: unreadable DER or a non-RSA key
  (BadCertificateInvalid), outside its validity (BadCertificateTimeInvalid), no URI SAN equal to the
  ApplicationUri (BadCertificateUriInvalid), an issuer chain that does not verify (BadCertificateInvalid), a
  CA-issued certificate whose issuer is neither given nor in the trust list (BadCertificateChainIncomplete), a
  key format outside SupportedPrivateKeyFormats or a key that is not PKCS #8 PEM / unencrypted PFX
  (BadNotSupported), a public key matching neither the given key, the CSR key nor the current key
  (BadSecurityChecksFailed).
- TrustList: the file is a bare UA Binary TrustListDataType (BadDecodingError otherwise). Open takes Read
  (1) or Write + EraseExisting (6); other OpenFileModes give BadNotSupported, 0 or unknown bits
  BadInvalidArgument. Readers see the applied list; handles belong to their session. Write past
  MaxTrustListSize: BadEncodingLimitsExceeded; CloseAndUpdate or AddCertificate producing a list over it:
  BadRequestTooLarge. ``trust_list_readable=False``: Open for reading and OpenWithMasks answer
  BadUserAccessDenied (writing works as usual). Certificates and CRLs must be DER and every CRL issued by a CA of
  the list (BadCertificateInvalid). AddCertificate and RemoveCertificate act at once, so they need no transaction
  (BadTransactionPending) and no open file (BadInvalidState); AddCertificate only adds trusted certificates
  whose issuer is in the list (else BadCertificateInvalid, BadCertificateChainIncomplete).
- GetRejectedList and GetCertificates (added to ServerConfiguration, asyncua's nodeset lacks it) are read-only.
- Client application certificates are trusted when in the trusted certificates or chaining to one through
  the issuer certificates without a revoking CRL; else CreateSession fails (BadCertificateUntrusted,
  BadCertificateRevoked, BadCertificateTimeInvalid, ...) and the certificate joins GetRejectedList. With
  ``auto_accept`` every certificate is accepted while the trust list is empty. A URI SAN must name the
  client's ApplicationUri either way (BadCertificateUriInvalid).
- ``fail_at="STEP"``, ``"STEP:BadSomeStatus"`` or ``"STEP:drop"`` (STEP: create_signing_request,
  update_certificate, trust_list_write, apply_changes, get_rejected_list, trust_list_read: Open for reading and
  OpenWithMasks) makes that step answer the status (BadInternalError by default) or take the device down without
  an answer, pending changes lost, until stopped or for ``down_s`` seconds; ``fail_count`` limits it to the first N
  calls, ``fail_after`` lets the first N calls through.
- ``drop_at="STEP"`` or ``"STEP:N"`` (STEP: open, write, close_and_update of a trust list being written,
  create_signing_request, update_certificate, apply_changes, or applied: after ApplyChanges took the changes in)
  closes the calling client's TCP connection without an answer at that step, on its first N calls (every call without
  N): a dropped session, the device staying up. The session's pending changes are discarded at once, as when it
  closes; ``installed_certificates`` counts what the device took in.
"""

from .config import SimulatorConfig
from .device import SimulatedDevice, run_devices
from .pki import TrustList

__all__ = ["SimulatedDevice", "SimulatorConfig", "TrustList", "run_devices"]
