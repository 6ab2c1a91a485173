"""What happens to a device over time: push orchestration, identification, monitoring, renewal, the schedulers with
maintenance suppression, leases, operation records and metrics. Imports the rooms below it.
"""
