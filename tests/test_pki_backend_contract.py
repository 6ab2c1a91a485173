"""The PKI-backend contract (``certlm.contracts.pki_backends.PkiBackend``): the host calls ``enroll`` and
``enroll_server_key`` with their documented arguments, a backend implements ``issue`` and ``issue_with_server_key``
on one ``EnrollmentRequest``, and ``offers`` tells which of them a backend implements."""

from __future__ import annotations

import pytest

from certlm.contracts.enrollment import SERVER_PROFILE, Enrollment, EnrollmentRequest, KeyedEnrollment
from certlm.contracts.pki_backends import PkiBackend
from certlm.foundation.errors import UnsupportedOperation
from tests.crypto_factory import device_csr, ec_key, make_ca


class RecordingPki(PkiBackend):
    """Signs every request with its own CA and remembers what it was asked."""

    pki_type = 150
    name = "recording"

    def __init__(self) -> None:
        super().__init__(services=None)
        self.ca = make_ca("Recording CA")
        self.requests: list[EnrollmentRequest] = []

    async def issue(self, entry, request: EnrollmentRequest) -> Enrollment:
        self.requests.append(request)
        return Enrollment(self.ca.sign_request(request.csr), (self.ca.certificate,))


class NothingPki(PkiBackend):
    pki_type = 151
    name = "nothing"


async def test_enroll_hands_the_backend_its_arguments_as_one_request() -> None:
    backend = RecordingPki()
    key = ec_key()
    csr = device_csr(key)
    old = (await backend.enroll(None, device_csr(), SERVER_PROFILE)).certificate

    enrollment = await backend.enroll(None, csr, SERVER_PROFILE, renewing=old, private_key=key)

    assert enrollment.certificate.public_key() == csr.public_key()
    assert backend.requests[-1] == EnrollmentRequest(csr, SERVER_PROFILE, renewing=old, private_key=key)
    assert "private_key" not in repr(backend.requests[-1])


async def test_what_a_backend_leaves_alone_is_not_offered_and_answers_501() -> None:
    backend = NothingPki(services=None)

    assert RecordingPki.offers("enroll") and not RecordingPki.offers("enroll_server_key")
    assert not NothingPki.offers("enroll")
    with pytest.raises(UnsupportedOperation) as refused:
        await backend.enroll(None, device_csr(), SERVER_PROFILE)
    assert refused.value.status == 501
    with pytest.raises(UnsupportedOperation):
        await backend.enroll_server_key(None, device_csr(), SERVER_PROFILE)


def test_a_backend_that_overrides_enroll_itself_offers_it() -> None:
    class DirectPki(PkiBackend):
        pki_type = 152
        name = "direct"

        async def enroll_server_key(self, entry, csr, profile, *, renewing=None) -> KeyedEnrollment:
            raise NotImplementedError

    assert DirectPki.offers("enroll_server_key")
    assert not DirectPki.offers("enroll")
