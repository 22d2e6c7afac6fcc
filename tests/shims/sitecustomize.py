"""Start-up shims for worker subprocesses in tests (on PYTHONPATH only when a test asks).

``CL_SHIM_NO_DNS=1``: host names ending in ``.invalid`` fail to resolve at once,
without asking a DNS server. ``CL_SHIM_HIDE_MODULE=psycopg``: that driver
cannot be imported, as if its extra were not installed.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

if os.environ.get("CL_SHIM_NO_DNS") == "1":
    _getaddrinfo = socket.getaddrinfo

    def _no_dns(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return _getaddrinfo(host, *args, **kwargs)

    socket.getaddrinfo = _no_dns

_hidden = os.environ.get("CL_SHIM_HIDE_MODULE")
if _hidden:

    class _Hide:
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name == _hidden or name.startswith(f"{_hidden}."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Hide())
