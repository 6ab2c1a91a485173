"""An example vendor plugin for certlm: the ACME Widget PLC, managed over its own HTTP interface."""
