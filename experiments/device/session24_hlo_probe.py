"""Session 24, call 2: writes the optimized HLO of the decode programs that
`tests/test_engine.py::test_decode_program_keeps_xla_split_k_out` compares (XLA's split-K heuristic first, then
the engine's) to ``argv[1]_0`` and ``argv[1]_1``, running the test's own body, to see what its check should match.
"""
import sys, re, inspect
sys.path.insert(0, "tests")
import test_engine as T
body = inspect.getsource(T.test_decode_program_keeps_xla_split_k_out)
body = body.replace("@pytest.mark.gpu\n", "").replace("def test_decode_program_keeps_xla_split_k_out", "def probe")
body = body.replace("        return lines, split", "        open(sys.argv[1] + '_' + str(len(PROBE)), 'w').write(hlo); PROBE.append(1)\n        return lines, split")
ns = dict(T.__dict__); ns["PROBE"] = []; ns["sys"] = sys
exec(body, ns)
try:
    ns["probe"]()
except AssertionError as e:
    print("assert", e)
