"""certlm: certificate lifecycle management for OPC UA devices.

Vendors write plugins with ``from certlm import hookimpl``; see ``certlm.hookspecs`` for the contracts.
"""

from certlm.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
