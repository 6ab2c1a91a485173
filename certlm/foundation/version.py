"""certlm's version, the version of its plugin API, its name as the system information gives it, and the end of support
of this release line."""

from datetime import date

__version__ = "0.1.0"
# The version of what plugins import (``certlm.__all__``) and the hooks they implement: the major number changes when
# something a plugin may use changes or goes, the minor one when something is added. A plugin declares the version it
# needs as ``CERTLM_PLUGIN_API = "1.0"`` in the module its entry point names; CHANGELOG.md says what each one holds.
PLUGIN_API_VERSION = "1.1"
SOFTWARE = "certlm Certificate Lifecycle Management for OPC UA"
# The end of support for this release line; announced with each release.
END_OF_LIFE = date(2031, 12, 31)
