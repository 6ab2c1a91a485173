"""The inventory of managed devices: entries, their lookup, credentials and URLs, the licensed endpoint count, bulk
import, and the mark of a device whose identity changed. Imports the rooms below it.
"""
