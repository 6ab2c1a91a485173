"""certlm starts without loading CMP's ASN.1 modules (RFC 9480's with what it imports took 1.0-1.8 s of every start on
a 2-core machine); the first CMP message built loads them."""

import subprocess
import sys

# A fresh interpreter: in this one other tests loaded the modules long ago. A module LazyLoader has not run yet is
# still of its own module type; running it makes it a plain module.
LOADED_AFTER_START_AND_AFTER_A_MESSAGE = """
import sys, types
from certlm.http.plugins import build_plugin_manager
from certlm import PkiBackendRegistry

def loaded():
    return sorted(name.rsplit(".", 1)[1] for name in ("pyasn1_alt_modules.rfc4210", "pyasn1_alt_modules.rfc9480")
                  if type(sys.modules.get(name)) is types.ModuleType)

registry = PkiBackendRegistry()
build_plugin_manager().hook.certlm_register_pki_backends(register=registry)
print(",".join(str(pki_type) for pki_type, _ in registry.classes()), loaded())
from certlm_pki_cmp import messages
from certlm_pki_cmp.asn1 import rfc9480
body = messages.genm_body(rfc9480.id_it_caCerts)
print(body.getName(), loaded())
"""


def test_the_cmp_asn1_modules_load_at_the_first_message_not_at_start() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LOADED_AFTER_START_AND_AFTER_A_MESSAGE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    at_start, after_a_message = result.stdout.splitlines()
    pki_types, loaded = at_start.split(" ", 1)
    assert "3" in pki_types.split(",")  # the CMP backend is registered...
    assert loaded == "[]"  # ...without its ASN.1 modules run
    assert after_a_message == "genm ['rfc4210', 'rfc9480']"
