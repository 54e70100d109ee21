"""Secrets and file-system hygiene: the signing secret, private cache directories.

Contracts:
- ``signing_secret`` returns the deployment's chunk-signing secret from ``store.signing_key`` or
  ``store.signing_key_file`` (None when signing is off). A key file readable by group or others,
  unreadable, or shorter than 16 bytes is a one-line ``ConfigError``. The secret is never logged.
- ``check_private_dir`` creates a cache directory owner-only (0700) and refuses one that another
  user owns or that group/others may write, unless ``allow_shared`` is set.
Side-effect free except for the directory ``check_private_dir`` is asked to create.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from typing import TYPE_CHECKING

from kvtier.chunk import MIN_MAC_KEY
from kvtier.config import ConfigError, StoreConfig

if TYPE_CHECKING:
    from pydantic import BaseModel

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def signing_secret(store: StoreConfig) -> bytes | None:
    if store.signing_key is not None:
        return store.signing_key.get_secret_value().encode()
    path = store.signing_key_file
    if path is None:
        return None
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"store.signing_key_file {path} is accessible by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"store.signing_key_file {path} cannot be read: {e.strerror or e}") from None
    if len(secret) < MIN_MAC_KEY:
        raise ConfigError(f"store.signing_key_file {path} holds {len(secret)} bytes; the secret needs >= {MIN_MAC_KEY}")
    return secret


class UnsafeDirectory(ValueError):
    """A cache directory other local users could read or plant files in (one-line reason)."""


def check_private_dir(path: Path, *, allow_shared: bool = False) -> None:
    """Create ``path`` (and parents) with mode 0700 if missing; refuse an existing directory owned
    by another user or writable by group/others unless ``allow_shared``. Raises UnsafeDirectory."""
    path = Path(path)
    if not path.exists():
        old = os.umask(0o077)
        try:
            path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        finally:
            os.umask(old)
        return
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if allow_shared:
        return
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"cache directory {path} is owned by uid {st.st_uid}, not this user "
                              f"(uid {os.geteuid()}); set allow_shared_dir to use it anyway")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"cache directory {path} is writable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); chmod 700 it or set allow_shared_dir")


def split_secrets(config: "BaseModel", prefix: str = "KVTIER_") -> tuple[dict, dict[str, str]]:
    """``config`` dumped to JSON-able data WITHOUT its secret fields, and those secrets as the
    ``KVTIER_*`` environment variables the config loader reads back (``KVTIER_STORE__SIGNING_KEY``).

    For handing a config to another process: secrets then travel in its environment (readable
    only by the same user), never on a command line (``ps`` shows it to every local user) nor in
    logs or reports."""
    from pydantic import BaseModel, SecretStr

    env: dict[str, str] = {}

    def walk(model: "BaseModel", path: list[str]) -> dict:
        out: dict = {}
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, SecretStr):
                env[prefix + "__".join(p.upper() for p in [*path, name])] = value.get_secret_value()
            elif isinstance(value, BaseModel):
                out[name] = walk(value, [*path, name])
            else:
                out[name] = type(model).__pydantic_serializer__.to_python(model, mode="json", include={name})[name]
        return out

    return walk(config, []), env


def drop_secret_fields(data: dict, secret_env: dict[str, str], prefix: str = "KVTIER_") -> None:
    """Remove from the nested ``data`` (a config as plain dicts) every field that ``secret_env``
    (``split_secrets``'s variables, e.g. ``KVTIER_STORE__SHARED__PASSWORD``) names; in place."""
    for name in secret_env:
        *parents, leaf = name[len(prefix):].lower().split("__")
        node: object = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
