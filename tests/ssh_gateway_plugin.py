"""A device plugin whose driver manages the ssh table with another URL scheme and port than OPC UA's. The tests
register it in process and install its source as a distribution of its own (``tests/test_entry_urls.py``)."""

from certlm import DeviceDriver, DeviceDriverRegistry, hookimpl


class GatewayOverSsh(DeviceDriver):
    """Any Linux gateway whose OPC UA certificate store is reached over SSH."""

    service = "ssh-test-gateway"
    protocol = "ssh"
    url_scheme = "ssh"
    default_port = 22
    generic = True


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(GatewayOverSsh)
