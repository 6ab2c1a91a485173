"""The service's own state: its license, its TLS certificate, the system settings and the code tables every area
shows devices with. Imports foundation, storage and contracts.
"""
