"""The integer codes and FLSD constants are declared twice, for Python/Triton (calibkernels/_kernel_codes.py) and for
the C++
and CUDA kernels (csrc/uncertainty_weighted_ce.h): the header must say what _kernel_codes.py says. Needs no compiled
extension (it reads the header's text)."""

import re
from pathlib import Path

from calibkernels import _kernel_codes

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "uncertainty_weighted_ce.h"


def _enum(text, name):
    """{member: value} of `enum class <name> : int64_t { A = 0, B = 1, ... };`."""
    match = re.search(rf"enum\s+class\s+{name}\s*:\s*int64_t\s*\{{([^}}]*)\}}", text)
    assert match, f"enum class {name} not found in {HEADER}"
    members = {}
    for entry in match.group(1).split(","):
        entry = entry.strip()
        if entry:
            key, value = (part.strip() for part in entry.split("="))
            members[key] = int(value)
    return members


def _snake(camel):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _constants(text):
    return {name: float(value) for name, value in
            re.findall(r"constexpr\s+double\s+(kFlsd\w+)\s*=\s*([0-9.eE+-]+)\s*;", text)}


def test_enums_match_the_python_codes():
    text = HEADER.read_text()
    for enum, codes in (("Weight", _kernel_codes.WEIGHT_CODES), ("Mode", _kernel_codes.MODE_CODES),
                        ("Reduction", _kernel_codes.REDUCTION_CODES), ("TargetFlag", _kernel_codes.TARGET_FLAG_CODES)):
        members = {_snake(key): value for key, value in _enum(text, enum).items()}
        assert members == codes, f"enum {enum} in {HEADER.name}: {members} != _kernel_codes: {codes}"


def test_flsd_constants_match_the_python_constants():
    constants = _constants(HEADER.read_text())
    expected = {
        "kFlsdLowThreshold": _kernel_codes.FLSD_LOW_THRESHOLD,
        "kFlsdLowGamma": _kernel_codes.FLSD_LOW_GAMMA,
        "kFlsdMidThreshold": _kernel_codes.FLSD_MID_THRESHOLD,
        "kFlsdMidGamma": _kernel_codes.FLSD_MID_GAMMA,
    }
    assert constants == expected
    assert (_kernel_codes.FLSD_LOW_THRESHOLD, _kernel_codes.FLSD_LOW_GAMMA, _kernel_codes.FLSD_MID_THRESHOLD,
            _kernel_codes.FLSD_MID_GAMMA) == (0.2, 5.0, 0.5, 3.0)


def test_the_dense_check_width_matches_the_python_constant():
    match = re.search(r"constexpr\s+int64_t\s+kDenseKernelCheckMaxClasses\s*=\s*(\d+)\s*;", HEADER.read_text())
    assert match and int(match.group(1)) == _kernel_codes.DENSE_KERNEL_CHECK_MAX_CLASSES


def test_the_parser_sees_a_changed_value():
    """The checks above would pass vacuously if the patterns found nothing: a header with a changed value fails."""
    text = HEADER.read_text().replace("Brier = 4", "Brier = 7").replace("kFlsdMidGamma = 3.0", "kFlsdMidGamma = 2.0")
    assert _enum(text, "Weight")["Brier"] == 7
    assert _constants(text)["kFlsdMidGamma"] == 2.0
