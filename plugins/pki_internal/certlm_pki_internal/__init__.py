"""certlm's internal CA: PKI type 1, a root CA per PKI entry that signs OPC UA application certificates."""
