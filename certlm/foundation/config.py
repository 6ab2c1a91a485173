"""Settings of one certlm instance, read from the environment (``CERTLM_*``) with explicit overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Every environment variable certlm reads starts with it.
ENVIRONMENT_PREFIX = "CERTLM_"


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    api_key_file: Path
    license_public_key_file: Path
    disabled_plugins: frozenset[str] = frozenset()
    max_body_bytes: int = 1024 * 1024
    public_url: str | None = None
    device_connect_timeout_s: float = 10.0
    device_operation_timeout_s: float = 60.0
    # One HTTP exchange with a PKI (EST, CMP) or a CRL distribution point.
    pki_request_timeout_s: float = 30.0
    # How long an enrollment the PKI holds pending (EST 202 + Retry-After, CMP waiting + pollReq) is waited for.
    pki_pending_wait_s: float = 300.0
    # How long an instance's claim on a device outlives the instance: after a crash, another takes over then.
    device_lease_s: float = 120.0
    # How many devices one scheduler scan works on at once.
    scheduler_concurrency: int = 8
    # How many registered devices are identified at once (each holds one connection while it is).
    identify_concurrency: int = 8
    # A device whose automated renewal failed is retried after this, doubling with each failure in a row, capped.
    scheduler_retry_base_s: float = 300.0
    scheduler_retry_max_s: float = 6 * 3600.0
    # The event loop watchdog behind ``certlm_event_loop_stall_seconds`` (``certlm.foundation.loop_watch``).
    loop_watch: bool = True
    # When set, the watchdog logs the loop thread's stack whenever the loop is held this long (diagnosis; off).
    loop_trace_ms: int | None = None
    # A source address that fails this many times at the API key (or at the TOTP of DELETE /sql) within the window
    # is refused with 429 until the window ends (``certlm.http.auth.FailureLimiter``).
    auth_failure_limit: int = 10
    auth_failure_window_s: float = 300.0
    # Plugins' settings by name: from the environment every ``CERTLM_*`` variable under its name without the prefix, in
    # lower case, as text for the plugin to check (``CERTLM_REST_VERIFY_WAIT_S`` is ``rest_verify_wait_s``); values
    # given in code (``overrides["extra"]``) win.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def secrets_dir(self) -> Path:
        return self.data_dir / "secrets"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = dict(os.environ if env is None else env)
        data_dir = Path(overrides.pop("data_dir", None) or env.get("CERTLM_DATA_DIR") or "certlm-data").resolve()
        settings = cls(
            data_dir=data_dir,
            database_url=env.get("CERTLM_DATABASE_URL") or f"sqlite://{data_dir / 'certlm.sqlite3'}",
            api_key_file=Path(env.get("CERTLM_API_KEY_FILE") or data_dir / "secrets" / "certlm_api_key.txt"),
            license_public_key_file=Path(
                env.get("CERTLM_LICENSE_PUBLIC_KEY_FILE") or data_dir / "secrets" / "license_public_key.pem"
            ),
            disabled_plugins=frozenset(
                name.strip() for name in env.get("CERTLM_DISABLE_PLUGINS", "").split(",") if name.strip()
            ),
            public_url=env.get("CERTLM_PUBLIC_URL") or None,
            device_connect_timeout_s=_seconds(env, "CERTLM_DEVICE_CONNECT_TIMEOUT_S", cls.device_connect_timeout_s),
            device_operation_timeout_s=_seconds(
                env, "CERTLM_DEVICE_OPERATION_TIMEOUT_S", cls.device_operation_timeout_s
            ),
            pki_request_timeout_s=_seconds(env, "CERTLM_PKI_REQUEST_TIMEOUT_S", cls.pki_request_timeout_s),
            pki_pending_wait_s=_seconds(env, "CERTLM_PKI_PENDING_WAIT_S", cls.pki_pending_wait_s),
            device_lease_s=_seconds(env, "CERTLM_DEVICE_LEASE_S", cls.device_lease_s),
            scheduler_concurrency=_count(env, "CERTLM_SCHEDULER_CONCURRENCY", cls.scheduler_concurrency),
            identify_concurrency=_count(env, "CERTLM_IDENTIFY_CONCURRENCY", cls.identify_concurrency),
            scheduler_retry_base_s=_seconds(env, "CERTLM_SCHEDULER_RETRY_BASE_S", cls.scheduler_retry_base_s),
            scheduler_retry_max_s=_seconds(
                env, "CERTLM_SCHEDULER_RETRY_MAX_S", cls.scheduler_retry_max_s, upper=7 * 24 * 3600
            ),
            loop_watch=_switch(env, "CERTLM_LOOP_WATCH", cls.loop_watch),
            loop_trace_ms=_count(env, "CERTLM_LOOP_TRACE_MS", 0, upper=60_000) or None,
            auth_failure_limit=_count(env, "CERTLM_AUTH_FAILURE_LIMIT", cls.auth_failure_limit, upper=100_000),
            auth_failure_window_s=_seconds(
                env, "CERTLM_AUTH_FAILURE_WINDOW_S", cls.auth_failure_window_s, upper=24 * 3600
            ),
        )
        from_environment = {
            name.removeprefix(ENVIRONMENT_PREFIX).lower(): value
            for name, value in env.items()
            if name.startswith(ENVIRONMENT_PREFIX)
        }
        overrides["extra"] = {**from_environment, **overrides.get("extra", {})}
        return replace(settings, **overrides)


def _switch(env: dict[str, str], name: str, default: bool) -> bool:
    """``on`` or ``off`` (also 1/0, true/false) from the environment; start-up fails naming the variable otherwise."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{name} must be on or off, got {raw!r}")
    return raw in ("on", "1", "true")


def _count(env: dict[str, str], name: str, default: int, upper: int = 256) -> int:
    """A whole number from 1 to ``upper`` from the environment; start-up fails naming the variable otherwise."""
    raw = env.get(name)
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and 1 <= int(raw) <= upper):
        raise ValueError(f"{name} must be a whole number from 1 to {upper}, got {raw!r}")
    return int(raw)


def _seconds(env: dict[str, str], name: str, default: float, upper: float = 3600) -> float:
    """A positive number of seconds from the environment; start-up fails naming the variable otherwise."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= upper:
        raise ValueError(f"{name} must be between 0 and {upper:g} seconds, got {raw!r}")
    return value
