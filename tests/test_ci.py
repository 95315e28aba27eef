"""`.ci/run` runs exactly the README's test command, in a fresh virtual environment, and fails
when the tests fail. The environment is faked with stub ``python3``/``pip``/``python``
executables on PATH, so this checks the script's control flow in milliseconds, not an install."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"


def readme_test_command() -> str:
    """The second command line of the README's first ```bash block (the test command)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    return lines[1].strip()


def ci_command() -> str:
    """The last non-comment line of .ci/run: the command it runs."""
    lines = [line.strip() for line in CI.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")][-1]


def test_ci_runs_exactly_the_readme_test_command():
    assert readme_test_command() == ci_command()
    assert "pytest" in ci_command()


def test_ci_makes_its_own_venv_without_system_site_packages():
    text = CI.read_text()
    assert re.search(r"^python3? -m venv ", text, re.M)
    assert "--system-site-packages" not in text
    assert re.search(r"^\. \"\$venv/bin/activate\"$", text, re.M)


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("pytest_rc", [0, 3])
def test_ci_fails_when_the_tests_fail(tmp_path, pytest_rc):
    """Stubs: ``python3 -m venv DIR`` writes DIR/bin/activate that puts stub ``pip`` and
    ``python`` first on PATH; the stub ``python -m pytest`` exits with ``pytest_rc``."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    venv_bin = tmp_path / "venv-bin"
    venv_bin.mkdir()
    _stub(
        bin_dir / "python3",
        f'echo "python3 $*" >> {log}\n'
        '[ "$1 $2" = "-m venv" ] || exit 90\n'
        'mkdir -p "$3/bin"\n'
        f'echo "export PATH={venv_bin}:\\$PATH" > "$3/bin/activate"\n',
    )
    _stub(venv_bin / "pip", f'echo "pip $*" >> {log}\n')
    _stub(venv_bin / "python", f'echo "python $*" >> {log}\nexit {pytest_rc}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(CI)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == pytest_rc, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("python3 -m venv ")
    assert calls[1:] == ["pip install torch==2.13.0", "pip install -e .[dev]", "python -m pytest -q"]
    # the temporary environment is removed afterwards
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("growtrain-ci.")]


# -- no global state leaks between tests (conftest fixtures) -----------------------------------
_LEAK: dict = {}


def test_isolation_a_consumes_global_state():
    import lightning as L

    _LEAK["first_draw"] = torch.rand(1).item()
    _LEAK["env"] = os.environ.get("PL_GLOBAL_SEED")
    _LEAK["threads"] = torch.get_num_threads()
    torch.rand(100)  # consume the global generator
    torch.set_num_threads(2)
    L.seed_everything(123)


def test_isolation_b_sees_a_fresh_state():
    """Runs after test_isolation_a (file order): it starts from the same random state, thread
    count and environment as if test_isolation_a had never run."""
    if "first_draw" not in _LEAK:
        pytest.skip("needs test_isolation_a_consumes_global_state to run first")
    assert torch.rand(1).item() == _LEAK["first_draw"]
    assert torch.get_num_threads() == _LEAK["threads"]
    assert os.environ.get("PL_GLOBAL_SEED") == _LEAK["env"]
