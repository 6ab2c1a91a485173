"""The ASN.1 modules of CMP (pyasn1-alt-modules), each loaded at its first use rather than when certlm starts.

pyasn1 builds every type of a module as it is imported, and RFC 9480's module with the ones it imports (RFC 4210,
4211, 5652, 6402, ...) took 1.0-1.8 s of every start of the service on a 2-core machine, most of it pyasn1 formatting
messages for errors it keeps in case a tag turns out ambiguous. A plant with no CMP PKI never needs them; with one,
the first message built or parsed loads them. The modules are the library's own, unchanged: ``importlib``'s
``LazyLoader`` only defers running each one until an attribute of it is read."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def _on_first_use(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rfc2986 = _on_first_use("pyasn1_alt_modules.rfc2986")
rfc4210 = _on_first_use("pyasn1_alt_modules.rfc4210")
rfc4211 = _on_first_use("pyasn1_alt_modules.rfc4211")
rfc5280 = _on_first_use("pyasn1_alt_modules.rfc5280")
rfc8018 = _on_first_use("pyasn1_alt_modules.rfc8018")
rfc9480 = _on_first_use("pyasn1_alt_modules.rfc9480")
