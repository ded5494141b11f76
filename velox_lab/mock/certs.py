"""Test certificates for the mock upstream's TLS listener.

A throwaway CA (trustme) signs one server certificate valid for 127.0.0.1, localhost and ::1.
Files written to the cert directory: `ca.pem` (what clients and the gateway trust),
`server.pem` (leaf + chain) and `server.key`. An existing complete set in the directory is
reused, so a demo or a gateway config can keep pointing at the same `ca.pem` across restarts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

IDENTITIES = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class CertPaths:
    ca_file: str
    cert_file: str
    key_file: str


def ensure_certs(certdir: str | os.PathLike[str]) -> CertPaths:
    """Create (or reuse) the CA and server certificate in `certdir`."""
    root = Path(certdir)
    paths = CertPaths(str(root / "ca.pem"), str(root / "server.pem"), str(root / "server.key"))
    if all(Path(p).is_file() and Path(p).stat().st_size for p in
           (paths.ca_file, paths.cert_file, paths.key_file)):
        return paths
    import trustme  # only needed when minting; keeps the import off the reuse path

    root.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="Velox mock upstream CA")
    leaf = ca.issue_cert(*IDENTITIES, organization_name="Velox mock upstream")
    _write(paths.key_file, leaf.private_key_pem.bytes(), private=True)
    _write(paths.cert_file, b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    # Written last: its presence is what marks the set as complete for a concurrent reader.
    _write(paths.ca_file, ca.cert_pem.bytes())
    return paths


def _write(path: str, data: bytes, private: bool = False) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
