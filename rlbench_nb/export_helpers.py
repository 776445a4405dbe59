"""The helpers every exported script carries: export.py copies their source into the script (which then
needs nothing of the exporter), so they live here as real code, linted and tested like the rest.

`_EMBEDDED` is the script's own table of the config files it embedded at export ({value: text}); here empty.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path

_EMBEDDED: dict[str, str] = {}


def _embedded(value):
    """A config file the notebook named, as it was at export: written once to a temporary file (named by its
    content) and that path returned. Any other value (a flag naming another file) is returned as given."""
    if value not in _EMBEDDED:
        return value
    text = _EMBEDDED[value]
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"rlbench-export-{digest}-{Path(value).name}"
    if not path.exists():  # written aside, then renamed: a run never reads half a file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return str(path)


def display(*objs, **_):
    """Notebook display() in a terminal: print each object's text form."""
    for obj in objs:
        print(obj)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _optional(text: str):
    """A parameter whose default is None: 'none'/'null' stay None, numbers become numbers, else text."""
    if text.lower() in ("none", "null", ""):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


HELPERS = (_embedded, display, _bool, _optional)  # in the order the script defines them
