"""The vendor contracts: what a plugin implements (a device driver, a PKI backend), the hooks it registers them
through, the registries the host looks them up in, and the services the host lends them. Imports foundation and
storage only.
"""
