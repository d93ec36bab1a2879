"""The uvicorn settings the server's flags make: HTTPS, the root path a proxy strips, the access log and its level,
and the connection limits (http_limits.py). Checked at start, before the engine loads: a missing or mismatched
certificate fails in a second, naming the flag."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from common.config import ServerConfig
from frontend.api.http_limits import uvicorn_limits


def check_http_flags(config: ServerConfig) -> None:
    """ValueError naming the flag and what is wrong with it."""
    if config.root_path and (not config.root_path.startswith("/") or config.root_path.endswith("/")):
        raise ValueError(f"--root-path {config.root_path!r}: a path that starts with / and does not end with one")
    files = {"--ssl-keyfile": config.ssl_keyfile, "--ssl-certfile": config.ssl_certfile,
             "--ssl-ca-certs": config.ssl_ca_certs}  # fmt: skip
    for name, path in files.items():
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name}: no such file: {path}")
    if (config.ssl_keyfile or config.ssl_ca_certs or config.ssl_cert_reqs) and not config.ssl_certfile:
        raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (HTTPS)")
    if config.ssl_cert_reqs and not config.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs: client certificates are checked against --ssl-ca-certs, which is missing")
    if config.ssl_certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # what uvicorn does with them once the model has loaded
            context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
            if config.ssl_ca_certs:
                context.load_verify_locations(config.ssl_ca_certs)
        except ssl.SSLError as exc:
            raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: {exc}") from None


def http_options(config: ServerConfig) -> dict[str, Any]:
    """Keyword arguments of uvicorn.Config."""
    return {"root_path": config.root_path, "access_log": not config.disable_uvicorn_access_log,
            "log_level": config.uvicorn_log_level or config.log_level, "ssl_keyfile": config.ssl_keyfile,
            "ssl_certfile": config.ssl_certfile, "ssl_ca_certs": config.ssl_ca_certs,
            "ssl_cert_reqs": config.ssl_cert_reqs, **uvicorn_limits(config)}  # fmt: skip
