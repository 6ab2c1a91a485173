"""The host's tables are made without tortoise reading their source: that reading (to find ``#:`` field comments,
which certlm does not write) was a quarter of every start-up of the service and of each CLI command."""

import subprocess
import sys

# Run in a fresh interpreter: in this one the models were made long ago, whatever the test would patch.
WHICH_MODELS_READ_THEIR_SOURCE = """
import tortoise.models
read = []
original = tortoise.models._get_comments
def recorded(cls):
    read.append(cls.__module__ + "." + cls.__name__)
    return original(cls)
tortoise.models._get_comments = recorded
from tortoise import Tortoise
import certlm.storage.models as host
tables = [name for name, value in vars(host).items()
          if isinstance(value, type) and issubclass(value, tortoise.models.Model) and not value._meta.abstract]
print(len(tables), [name for name in read if name.startswith("certlm.")])
"""


def test_no_host_table_reads_its_source_when_it_is_made() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WHICH_MODELS_READ_THEIR_SOURCE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    tables, read = result.stdout.split(maxsplit=1)
    assert int(tables) >= 20
    assert read.strip() == "[]"
