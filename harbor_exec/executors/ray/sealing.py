"""Sealing a trial's secrets for one Ray node's actor (X25519 ECIES).

Each node actor makes an X25519 key pair in memory at start (``Opener``) and
publishes only the public key; the driver seals each call with a fresh ephemeral
key (X25519 -> HKDF-SHA256 -> AES-256-GCM). What Ray stores, logs, spills or shows
is ciphertext; only that actor's process can open it. ``cryptography`` comes with
the ``ray`` extra and is imported on first use.
"""

from __future__ import annotations

import os
from typing import Any

_INFO = b"harbor-exec ray seal v1"


def _crypto() -> Any:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return hashes, serialization, X25519PrivateKey, X25519PublicKey, AESGCM, HKDF


def _derive(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> bytes:
    hashes, _ser, _priv, _pub, _aes, hkdf = _crypto()
    return bytes(
        hkdf(
            algorithm=hashes.SHA256(),
            length=32,
            salt=ephemeral_public + recipient_public,
            info=_INFO,
        ).derive(shared)
    )


def _raw_public(key: Any) -> bytes:
    _h, serialization, _priv, _pub, _aes, _hkdf = _crypto()
    return bytes(
        key.public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)
    )


def seal(recipient_public: bytes, payload: bytes) -> bytes:
    """Encrypt ``payload`` for the holder of ``recipient_public`` (X25519 ECIES)."""
    _h, _ser, private_cls, public_cls, aesgcm, _hkdf = _crypto()
    ephemeral = private_cls.generate()
    ephemeral_public = _raw_public(ephemeral.public_key())
    shared = ephemeral.exchange(public_cls.from_public_bytes(recipient_public))
    key = _derive(shared, ephemeral_public, recipient_public)
    nonce = os.urandom(12)
    return ephemeral_public + nonce + bytes(aesgcm(key).encrypt(nonce, payload, _INFO))


class Opener:
    """An X25519 key pair held in memory; ``open`` reverses ``seal``."""

    def __init__(self) -> None:
        _h, _ser, private_cls, _pub, _aes, _hkdf = _crypto()
        self._private = private_cls.generate()
        self.public = _raw_public(self._private.public_key())

    def open(self, sealed: bytes) -> bytes:
        _h, _ser, _priv, public_cls, aesgcm, _hkdf = _crypto()
        ephemeral_public, nonce, body = sealed[:32], sealed[32:44], sealed[44:]
        shared = self._private.exchange(public_cls.from_public_bytes(ephemeral_public))
        key = _derive(shared, ephemeral_public, self.public)
        return bytes(aesgcm(key).decrypt(nonce, body, _INFO))


__all__ = ["Opener", "seal"]
