"""Imports every command module so that each registers itself on the app."""

# ruff: noqa: F401, I001  (imported for their side effect: registering commands)
from harbor_exec.cli import dataset
from harbor_exec.cli import run
from harbor_exec.cli import images
from harbor_exec.cli import bundle
from harbor_exec.cli import serve
