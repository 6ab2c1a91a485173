"""certlm plugin for ACME Widget PLCs: the Widget's OPC UA push driver (``driver``), ACME's key vault as a PKI
backend (``key_vault``), and the hooks that hand both to certlm (``plugin``, this distribution's entry point)."""
