"""Plugins that ship with the host."""
