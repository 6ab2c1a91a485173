"""certlm-ssh: OPC UA servers whose certificate store is a directory on a Linux host certlm reaches over SSH."""
