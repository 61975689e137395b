"""Ray token authentication for the private head: a fresh token in a 0600 file, and who reads it.

    head (`ray start`)   RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=<temp dir>/auth_token in its env
    raylet's workers     inherit both from the head (our actors need nothing more)
    this process         `driver_auth` around `ray.init`: set, read by Ray, then os.environ restored

A cluster joined with `address` is the user's: its auth mode and token come from the user's own
RAY_AUTH_* settings, untouched here.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # not in its .pyi

MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def write_token(path: Path) -> Path:
    """A fresh random token (Ray's own kind: 256 bits, hex) in a new file only we can read."""
    # NOTE: random, not derived from the cluster secret: only this process and its head need it,
    # and a Ray worker that can read it learns nothing about the secret that signs our messages.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def head_env(token_path: Path) -> dict[str, str]:
    """The private head's environment: token mode with the token in `token_path`."""
    env = {**os.environ, MODE_ENV: "token", TOKEN_PATH_ENV: str(token_path)}
    env.pop(TOKEN_ENV, None)  # it would win over the file (Ray: env, then file, then ~/.ray/auth_token)
    return env


@contextmanager
def driver_auth(token_path: Path) -> Iterator[None]:
    """Within: this process's next `ray.init` authenticates with the token in `token_path`.

    Ray's C++ core reads RAY_AUTH_* from the environment, but only when told to: the mode when its
    config is (re)initialized, the token when its cache is empty. So we set them, reload both, and
    restore os.environ on the way out; Ray keeps what it read while connected. On an error, and
    after `ray.shutdown` (`forget_driver_auth`), Ray is set back to the environment's settings."""
    saved = {k: os.environ.get(k) for k in (MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV)}
    os.environ.pop(TOKEN_ENV, None)
    os.environ.update({MODE_ENV: "token", TOKEN_PATH_ENV: str(token_path)})
    connected = False
    try:
        _reload()
        yield
        connected = True
    finally:
        _restore(saved)
        if not connected:
            _reload()


def forget_driver_auth() -> None:
    """After `ray.shutdown`: drop the private head's token and mode from Ray's caches."""
    _reload()


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _reload() -> None:
    Config.initialize("")  # RayConfig from the environment (how Ray itself turns token mode on)
    AuthenticationTokenLoader.instance().reset_cache()
