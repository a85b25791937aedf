"""The README's commands and example are the ones CI and users run: keep them true."""

import re
import subprocess
import sys
from pathlib import Path

import calibkernels as ck

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_commands = [line for block in _bash_blocks(readme) for line in block.splitlines() if "pytest" in line]
    assert test_commands, "README must show the install-and-test command"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0].strip() in ci_lines


def test_readme_main_job_is_the_training_cli():
    readme = (ROOT / "README.md").read_text()
    assert any("python -m training.train" in block for block in _bash_blocks(readme))


def test_readme_api_example_runs():
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## API\n.*?```python\n(.*?)```", readme, flags=re.S).group(1)
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ECE" in result.stdout and "backends here" in result.stdout


def test_every_registry_name_builds_a_module_with_a_readable_repr():
    for name in ck.losses.names():
        module = ck.losses.build(name)
        assert type(module).__name__ in repr(module) and "reduction='mean'" in repr(module)


def test_import_never_needs_the_compiled_extension():
    code = (
        "import sys; sys.modules['calibkernels._C'] = None\n"  # make `import calibkernels._C` fail
        "import warnings, torch, calibkernels as ck\n"
        "assert 'cpu' not in ck.available_backends(), ck.available_backends()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    ck.bsce_gra_loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))\n"
        "assert any('falling back' in str(x.message) for x in w)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
