"""No two sibling modules or packages import each other, counting the imports made only for type checking.

A cycle hidden behind `if TYPE_CHECKING:` is still a cycle a reader has to hold in their head (and the first
runtime use of such an import breaks the program). The main contracts (pyproject.toml) leave type-checking
imports out, so that a type named in a signature does not count as a dependency of the layers; this one contract
counts them, run here with its own configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.procs import REPO_ROOT

CONFIG = '''[tool.importlinter]
root_packages = ["kvbaton"]
exclude_type_checking_imports = false

[[tool.importlinter.contracts]]
name = "No cycles between sibling modules or packages, type-checking imports included"
type = "acyclic_siblings"
ancestors = ["kvbaton"]
'''


def test_no_cycle_between_siblings_even_for_type_checking(tmp_path: Path) -> None:
    config = tmp_path / "cycles.toml"
    config.write_text(CONFIG)
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(config), "--no-cache", "--no-logo"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
