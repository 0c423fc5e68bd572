"""CurveZMQ keys: generation (`offpolicy keys DIR`) and loading for servers and clients.

Layout of a keys directory (what `generate` writes):
    server.key            the learner's public key: give it to every client
    server.key_secret     the learner's key pair: the learner only (0600)
    clients/<name>.key    the allowlist: public keys of the clients the learner accepts
    <name>.key_secret     one client's key pair: give it to that rollout / subscriber only (0600)
A client is let in only if its public key is in `clients/`. Removing a file there and restarting the
learner revokes that client.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


@dataclass(frozen=True)
class CurveServer:
    public: bytes
    secret: bytes
    allowlist: Path  # directory of accepted client public keys


@dataclass(frozen=True)
class CurveClient:
    server_public: bytes
    public: bytes
    secret: bytes


def generate(directory: str | os.PathLike, clients: list[str]) -> Path:
    """Create (or extend) a keys directory with a server key pair and one key pair per client name."""
    root = Path(directory)
    (root / "clients").mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    with tempfile.TemporaryDirectory() as tmp:
        if not (root / "server.key_secret").exists():
            pub, sec = zmq.auth.create_certificates(tmp, "server")
            shutil.move(pub, root / "server.key")
            shutil.move(sec, root / "server.key_secret")
        for name in clients:
            if (root / f"{name}.key_secret").exists():
                raise FileExistsError(f"{root / name}.key_secret exists: pick another client name")
            pub, sec = zmq.auth.create_certificates(tmp, name)
            shutil.move(pub, root / "clients" / f"{name}.key")
            shutil.move(sec, root / f"{name}.key_secret")
    for secret in root.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return root


def load_server(directory: str | os.PathLike) -> CurveServer:
    root = Path(directory)
    path = root / "server.key_secret"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: create keys with `offpolicy keys {root}` "
                                "(transport.keys_dir names the directory)")
    public, secret = zmq.auth.load_certificate(path)
    if not (root / "clients").is_dir():
        raise FileNotFoundError(f"{root / 'clients'} is missing: it holds the public keys of allowed clients")
    return CurveServer(public=public, secret=secret, allowlist=root / "clients")


def load_client(directory: str | os.PathLike, name: str) -> CurveClient:
    root = Path(directory)
    server_public, _ = zmq.auth.load_certificate(root / "server.key")
    path = root / f"{name}.key_secret"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: create it with `offpolicy keys {root} --client {name}` "
                                "(transport.client_key names it)")
    public, secret = zmq.auth.load_certificate(path)
    return CurveClient(server_public=server_public, public=public, secret=secret)


def apply_server(sock: zmq.Socket, keys: CurveServer) -> None:
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def apply_client(sock: zmq.Socket, keys: CurveClient) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def curve_server(ctx: zmq.Context, sockets: list[zmq.Socket], directory: str | os.PathLike):
    """Make `sockets` (not yet bound) CurveZMQ servers with the key pair of `directory`, and start the
    ZAP authenticator of `ctx` that lets only the allowlisted client keys through; returns it (stop it
    when the sockets close)."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    keys = load_server(directory)
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.allowlist))
    for sock in sockets:
        apply_server(sock, keys)
    return auth
