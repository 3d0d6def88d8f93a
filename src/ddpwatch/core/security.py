"""CurveZMQ encryption and authentication for ddpwatch's sockets (see ``docs/security.md``).

Server: ``ServerCurve.from_files(secret_file, clients_dir)`` makes the rank (PULL) and
query (REP) sockets CURVE servers; a ZAP handler (pyzmq's ``ThreadAuthenticator``)
lets in any client that knows the server's public key, or with ``clients_dir`` only
the client public keys listed there.

Clients (the rank agent, ``ddpwatch status``, the dashboard's remote source):
``apply_client_curve(sock)`` turns CURVE on when ``DDPWATCH_SERVER_KEY`` (the
server's Z85 public key) is set, with the key pair from ``DDPWATCH_CLIENT_KEY_FILE``
or else a fresh one made for this socket.

Nothing here imports torch; ``zmq.auth`` is imported only on the server side.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

log = logging.getLogger("ddpwatch")

SERVER_KEY_ENV = "DDPWATCH_SERVER_KEY"
CLIENT_KEY_FILE_ENV = "DDPWATCH_CLIENT_KEY_FILE"
KEY_NAME = "ddpwatch"
Z85_KEY_LEN = 40  # 32 bytes of key in Z85 text


class CurveKeyError(ValueError):
    """A key or key file that cannot be used; the message says which and why."""


def _z85_key(value: bytes | str, what: str) -> bytes:
    """A 40-character Z85 CURVE key as bytes, or ``CurveKeyError``."""
    key = value.encode("ascii", "replace") if isinstance(value, str) else bytes(value)
    key = key.strip()
    if len(key) != Z85_KEY_LEN:
        raise CurveKeyError(f"{what} must be a {Z85_KEY_LEN}-character Z85 key, got {len(key)}")
    try:
        if len(z85.decode(key)) != 32:
            raise ValueError
    except Exception:  # KeyError for a bad character, struct.error for an overflow
        raise CurveKeyError(f"{what} is not a Z85 key") from None
    return key


def load_key_file(path: str | os.PathLike[str], *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a ZeroMQ certificate file; ``secret`` requires the secret key."""
    try:
        public, secret_key = _load_certificate(path)
    except OSError as exc:
        raise CurveKeyError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CurveKeyError(f"{path} is not a ZeroMQ key file: {exc}") from None
    public = _z85_key(public, f"the public key in {path}")
    if not secret:
        return public, None
    if secret_key is None:
        raise CurveKeyError(
            f"{path} holds no secret key: pass the .key_secret file, not the public .key"
        )
    return public, _z85_key(secret_key, f"the secret key in {path}")


def _load_certificate(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not Path(path).is_file():
        raise OSError(0, "no such file", str(path))
    return zmq.auth.load_certificate(path)


# --------------------------------------------------------------------------- keygen


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def generate_keys(
    directory: str | os.PathLike[str], name: str = KEY_NAME, force: bool = False
) -> tuple[Path, Path, str]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) into ``directory``.

    Returns (public file, secret file, public key). Refuses to overwrite existing
    keys unless ``force``.
    """
    import zmq.auth

    folder = Path(directory)
    public_file, secret_file = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [p for p in (public_file, secret_file) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} already exists (pass --force to replace it)")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in existing:
        path.unlink()
    with _private_umask():  # the secret file is never readable by others, not even briefly
        zmq.auth.create_certificates(folder, name)
    secret_file.chmod(0o600)
    public_file.chmod(0o644)
    public, _ = zmq.auth.load_certificate(public_file)
    return public_file, secret_file, public.decode("ascii")


def keygen_main(args: argparse.Namespace) -> int:
    """``ddpwatch keygen [DIR] [--name NAME] [--force]``."""
    try:
        public_file, secret_file, public = generate_keys(args.dir, args.name, args.force)
    except OSError as exc:
        print(f"ddpwatch keygen: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {secret_file} (secret, mode 0600) and {public_file} (public)")
    print(f"public key: {public}")
    if args.name == KEY_NAME:
        print("\nserver:  ddpwatch serve --curve-secret-file " + str(secret_file))
        print(f"ranks and ddpwatch status:  export {SERVER_KEY_ENV}='{public}'")
    else:
        print(
            f"\nclient key: copy {public_file} into the server's --curve-clients directory;"
            f"\non the client:  export {CLIENT_KEY_FILE_ENV}={secret_file}"
        )
    return 0


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerCurve:
    """The server's CURVE key pair and who may connect (``clients_dir``: None = anyone with
    the server's public key)."""

    public: bytes
    secret: bytes
    clients_dir: Path | None = None

    @classmethod
    def from_files(
        cls,
        secret_file: str | os.PathLike[str],
        clients_dir: str | os.PathLike[str] | None = None,
    ) -> ServerCurve:
        public, secret = load_key_file(secret_file, secret=True)
        assert secret is not None
        folder = None
        if clients_dir is not None:
            folder = Path(clients_dir)
            if not folder.is_dir():
                raise CurveKeyError(f"--curve-clients {folder} is not a directory")
            if not client_public_keys(folder):
                raise CurveKeyError(
                    f"no client public keys (*.key) in {folder}: every client would be refused"
                )
        return cls(public, secret, folder)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before it binds)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

    def start_authenticator(self, context: zmq.Context[Any]) -> Any:
        """Start the ZAP handler on ``context`` (the one the server's sockets use)."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context, log=logging.getLogger("ddpwatch.auth"))
        auth.start()
        location = str(self.clients_dir) if self.clients_dir else zmq.auth.CURVE_ALLOW_ANY
        auth.configure_curve(domain="*", location=location)
        return auth


def client_public_keys(folder: str | os.PathLike[str]) -> list[bytes]:
    """The client public keys in ``folder`` (``*.key`` certificate files)."""
    keys = []
    for path in sorted(Path(folder).glob("*.key")):
        try:
            keys.append(load_key_file(path, secret=False)[0])
        except CurveKeyError as exc:
            log.warning("ignoring %s: %s", path, exc)
    return keys


# --------------------------------------------------------------------------- clients


def client_curve_keys(
    environ: Mapping[str, str] | None = None,
) -> tuple[bytes, bytes, bytes] | None:
    """(server public, client public, client secret) from the environment, or None when
    ``DDPWATCH_SERVER_KEY`` is unset (plain TCP). Raises ``CurveKeyError`` for bad keys."""
    env = os.environ if environ is None else environ
    server_key = env.get(SERVER_KEY_ENV, "").strip()
    if not server_key:
        return None
    server = _z85_key(server_key, SERVER_KEY_ENV)
    key_file = env.get(CLIENT_KEY_FILE_ENV, "").strip()
    if key_file:
        public, secret = load_key_file(key_file, secret=True)
        assert secret is not None
    else:
        public, secret = zmq.curve_keypair()  # ephemeral: encryption + server authentication
    return server, public, secret


def apply_client_curve(sock: zmq.Socket[Any], environ: Mapping[str, str] | None = None) -> bool:
    """Turn CURVE on for a client socket (before it connects) when the environment asks.

    Returns True when it did. Raises ``CurveKeyError`` for a bad key: callers must
    then not connect in the clear.
    """
    keys = client_curve_keys(environ)
    if keys is None:
        return False
    server, public, secret = keys
    sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return True


# --------------------------------------------------------------------------- binding

_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "::1", "[::1]", "lo"})


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.x, ::1, localhost)."""
    host = host.strip().lower()
    return host in _LOOPBACK_NAMES or host.startswith("127.")
