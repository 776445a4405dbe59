"""Imports that cost a process seconds for nothing it uses, put off until they are used. Cheap to import itself
(nothing but the standard library), so a script can call it first.
"""
from __future__ import annotations

import sys


def defer_rfc3987_syntax() -> None:
    """`import ray` imports jsonschema, whose format module imports rfc3987_syntax when it is installed (Jupyter's
    jsonschema[format-nongpl] brings it), which compiles its grammars at import: ~2.5 s of every controller's
    start on a 2-core machine, for two format checks ("iri", "iri-reference") that neither Ray nor we use. A
    stand-in module answers jsonschema's import and loads the real one at the first check, which then behaves
    as it always did."""
    import importlib.util
    if "rfc3987_syntax" in sys.modules or "jsonschema" in sys.modules:
        return
    if importlib.util.find_spec("rfc3987_syntax") is None:
        return
    import types
    real: list = []  # the real module, once something needs it

    def load():
        if not real:
            del sys.modules["rfc3987_syntax"]
            import rfc3987_syntax  # the real one, now: ~2.5 s, once
            real.append(rfc3987_syntax)
        return real[0]

    def is_valid_syntax(*args, **kwargs):  # what jsonschema imports by name
        return load().is_valid_syntax(*args, **kwargs)

    stand_in = types.ModuleType("rfc3987_syntax", "stand-in until first used (rlbench_nb.fast_imports)")
    stand_in.is_valid_syntax = is_valid_syntax

    def __getattr__(name: str):  # anything else: the real module's (not the import system's probes, __path__ & co)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(load(), name)

    stand_in.__getattr__ = __getattr__
    sys.modules["rfc3987_syntax"] = stand_in
