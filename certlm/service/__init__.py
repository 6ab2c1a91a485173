"""The running service put together: the host object that holds every part, the system information it reports,
and database administration. Imports the rooms below it.
"""
