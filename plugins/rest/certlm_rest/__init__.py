"""certlm's drivers for OPC UA servers whose certificates are managed through a vendor HTTP(S) API."""
