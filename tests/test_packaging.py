"""The README's commands and example are the ones CI and users run: keep them true."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


def _calibkernels_imports():
    """``{module: modules of calibkernels it imports}``, read statically from every import statement at any depth
    (an import inside a function counts: it only moves a cycle to run time). The compiled ``_C`` is a leaf."""
    import ast

    modules = {}
    for path in (ROOT / "calibkernels").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names if alias.name != "_C"] or []
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def test_the_package_has_no_import_cycles():
    """Each module of calibkernels sits on one floor: no module reaches itself through the modules it imports."""
    edges = _calibkernels_imports()
    for start in edges:
        seen, frontier = set(), [(start, (start,))]
        while frontier:
            module, path = frontier.pop()
            for target in edges[module]:
                assert target != start, f"import cycle: {' -> '.join(path + (start,))}"
                if target not in seen:
                    seen.add(target)
                    frontier.append((target, path + (target,)))


# ------------------------------------------------------------------------------------------ wheel layout (issue #20)
def _package_folders():
    """Every package folder of the checkout, by the name it installs under: calibkernels/…, and training/… as
    calibkernels.training…"""
    names = set()
    for top, installed in (("calibkernels", "calibkernels"), ("training", "calibkernels.training")):
        for init in (ROOT / top).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / top).parts
            if "__pycache__" not in relative:
                names.add(".".join((installed, *relative)))
    return names


def test_pyproject_installs_training_inside_calibkernels():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_config = config["tool"]["setuptools"]
    assert setuptools_config["package-dir"] == {"calibkernels.training": "training"}
    assert set(setuptools_config["packages"]) == _package_folders()
    assert all(name.split(".")[0] == "calibkernels" for name in setuptools_config["packages"])
    assert config["project"]["scripts"]["calib-train"] == "calibkernels.training.train:cli"


def test_imports_inside_training_are_relative():
    """`python -m training.train` (checkout) and the installed calibkernels.training must run the same code."""
    import ast

    absolute = []
    for path in (ROOT / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            absolute += [f"{path.relative_to(ROOT)}:{node.lineno} {m}" for m in modules
                         if m.split(".")[0] == "training"]
    assert not absolute, absolute


@pytest.fixture(scope="module")
def pure_python_wheel(tmp_path_factory):
    """The wheel of a copy of the checkout, built without compiling the extension (CALIBKERNELS_SKIP_EXT=1)."""
    import os
    import shutil

    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build", "results", "runs")
    for name in ("calibkernels", "training"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                             "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "CALIBKERNELS_SKIP_EXT": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("calibkernels-*.whl")
    return wheel


def test_wheel_has_no_top_level_training_module(pure_python_wheel):
    import zipfile

    with zipfile.ZipFile(pure_python_wheel) as wheel:
        names = wheel.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        top_level = wheel.read(f"{dist_info}/top_level.txt").decode().split()
        entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"calibkernels", dist_info}
    assert top_level == ["calibkernels"]
    expected = {f"calibkernels/training/{path.relative_to(ROOT / 'training').as_posix()}"
                for path in (ROOT / "training").rglob("*.py") if "__pycache__" not in path.parts}
    assert expected <= set(names), sorted(expected - set(names))
    assert "calib-train = calibkernels.training.train:cli" in entry_points


@pytest.mark.slow
def test_installed_wheel_runs_calib_train(pure_python_wheel, tmp_path):
    """Installed into a folder of its own (which comes first on sys.path), the console script and
    `python -m calibkernels.training.train` work from any folder."""
    import os

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                              str(target), str(pure_python_wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import calibkernels.training.train as t; assert t.__file__.startswith(%r), t.__file__; "
            "assert t.cli(['--list-recipes']) == 0" % str(target))
    for argv in ([str(target / "bin" / "calib-train"), "--help"],
                 [sys.executable, "-m", "calibkernels.training.train", "--help"],
                 [sys.executable, "-c", code]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert result.returncode == 0, (argv, result.stderr[-3000:])
    assert "digits" in result.stdout  # the recipe list


# ---------------------------------------------------------------------------------- documented training commands
def _documented_commands():
    """Every `python -m training.train …`, `torchrun … -m training.train …`, `calib-train …` and
    `python -m training.evaluate …` command shown in training/README.md and README.md, as (module, argv)."""
    commands = []
    for doc in ("training/README.md", "README.md"):
        text = (ROOT / doc).read_text()
        snippets = re.findall(r"`([^`\n]+)`", text)
        snippets += [line for block in _bash_blocks(text) for line in block.splitlines()]
        for snippet in snippets:
            snippet = snippet.split("#")[0].strip()
            match = re.search(r"(?:-m (?:calibkernels\.)?training\.(train|evaluate)|^calib-(train))(?:\s|$)(.*)",
                              snippet)
            if match:
                argv = [token.replace("…", "x") for token in shlex.split(match.group(3).replace("$DATA", "/data"))
                        if token != "…"]  # `calib-train …`: any arguments
                commands.append((match.group(1) or match.group(2), argv, f"{doc}: {snippet}"))
    return commands


def test_documented_training_commands_parse():
    from training import evaluate, train

    commands = _documented_commands()
    assert sum(module == "train" for module, _, _ in commands) >= 12  # one per recipe and more
    for module, argv, where in commands:
        if module == "evaluate":
            evaluate.get_args_parser().parse_args(argv)
            continue
        try:
            args = train.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the parser rejects {where}")
        for spec in [args.loss] + (args.compare.split(",") if args.compare else []):
            assert train.parse_loss_spec(spec)[0] in ck.losses.names(), where


def test_documented_loss_specs_parse():
    """The `--loss` examples of training/README.md name registry losses with KEY=VALUE hyperparameters (parsed here;
    building them is the losses' tests' business)."""
    from training import train

    text = (ROOT / "training" / "README.md").read_text()
    specs = [s for s in re.findall(r"`([a-z_0-9]+(?::[a-z_]+=[^`:]+)+)`", text)]
    assert "mmce_weighted:lam=2" in specs
    for spec in specs:
        name, hyperparameters = train.parse_loss_spec(spec)
        assert name in ck.losses.names() and hyperparameters, spec


def test_training_readme_compare_table_is_the_commands_output():
    """The --compare table of training/README.md holds the numbers of training/results/digits/comparison.json, which
    the documented command wrote."""
    import json

    results = json.loads((ROOT / "training" / "results" / "digits" / "comparison.json").read_text())
    text = (ROOT / "training" / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| loss")
            and "/" in line and line.split("|")[1].strip().split()[0] in results]
    assert len(rows) == len(results) == 5
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        report = results[cells[0].split()[0]]
        pre, post = report["pre_T"], report["post_T"]
        pair = lambda key, scale, digits: f"{scale * pre[key]:.{digits}f} / {scale * post[key]:.{digits}f}"
        assert cells[1:] == [f"{report['temperature']:.2f}", f"{100 * pre['accuracy']:.2f}", pair("ece", 100, 2),
                             pair("adaece", 100, 2), pair("classwise_ece", 100, 2), pair("nll", 1, 4),
                             pair("brier", 1, 4)], row
