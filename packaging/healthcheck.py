"""The container's health check: ``GET /systeminfo`` (an open route) on this container's certlm answers 200.

certlm serves HTTPS once a TLS certificate is installed (its own self-signed one, or the operator's), HTTP before:
both are tried. The certificate is not verified: this connects to 127.0.0.1 only, to ask whether certlm answers.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

HEALTH_PATH = "/systeminfo"


def healthy(port: str) -> bool:
    unverified = ssl._create_unverified_context()
    for scheme in ("https", "http"):
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}{HEALTH_PATH}", timeout=5, context=unverified):
                return True
        except urllib.error.HTTPError:
            return False  # it answered, but not 200 (503 while it stops)
        except (urllib.error.URLError, OSError):
            continue
    return False


if __name__ == "__main__":
    sys.exit(0 if healthy(os.environ.get("CERTLM_PORT", "5000")) else 1)
