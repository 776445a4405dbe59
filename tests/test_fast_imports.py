"""fast_imports.py: rfc3987_syntax put off until used, with jsonschema's format checks answering as before."""
import subprocess
import sys

import pytest

pytest.importorskip("rfc3987_syntax")

CHECKS = """
import sys
{setup}
import jsonschema
compiled_at_import = "lark" in sys.modules  # rfc3987_syntax's grammars are lark's
checker = jsonschema.FormatChecker()
cases = ["http://example.com/ä", "http://a b", "//x/y?q#f", "not a uri at all ::", "mailto:ä@b.c"]
iri = [checker.conforms(c, "iri") for c in cases]
ref = [checker.conforms(c, "iri-reference") for c in cases]
import rfc3987_syntax
direct = rfc3987_syntax.is_valid_syntax("iri", "http://x/ä")  # the module used directly, not through jsonschema
print(repr((iri, ref, direct, sorted(rfc3987_syntax.RFC3987_SYNTAX_TERMS)[:3], compiled_at_import)))
"""


def _run(setup: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", CHECKS.format(setup=setup)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_the_stand_in_answers_every_check_as_the_real_module_does():
    plain = _run("")
    deferred = _run("from rlbench_nb.fast_imports import defer_rfc3987_syntax; defer_rfc3987_syntax()")
    assert deferred[:4] == plain[:4]
    assert plain[0] == [True, False, False, False, True]  # what rfc3987_syntax says of the cases (iri)
    # the point of it: jsonschema imports without compiling the grammars (~2.5 s on a 2-core machine)
    assert plain[4] is True and deferred[4] is False
