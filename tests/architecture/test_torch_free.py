"""The processes that never run the model load no torch: every module the torch-free contract names (pyproject.toml:
the frontend's packages, the scheduler, the tools that never run the model) imports with torch made unimportable.
(Import-linter, run by the test command, keeps that contract over kvbaton's own imports; this checks the one thing
it cannot: that no third-party package in the chain pulls torch in.)"""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: import-linter's own dependency reads TOML there
    import tomli as tomllib

from tests.support.procs import REPO_ROOT


def _contract_modules() -> list[str]:
    """The torch-free contract's source modules (pyproject.toml, import-linter), packages as they are named."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = [c for c in config["contracts"] if c["type"] == "forbidden" and c["forbidden_modules"] == ["torch"]]
    assert len(contracts) == 1, "one import-linter contract forbids torch: the torch-free boundary"
    return list(contracts[0]["source_modules"])


def _with_submodules(name: str) -> list[str]:
    """A package and every module in it (a module alone otherwise): what the contract covers. Found on disk, not
    by importing (`__main__` modules run a CLI when imported: left out)."""
    spec = find_spec(name)
    assert spec is not None, f"{name} is named by the torch-free contract but does not exist"
    if spec.submodule_search_locations is None:
        return [name]
    package = Path(next(iter(spec.submodule_search_locations)))
    modules = (path.relative_to(package).with_suffix("") for path in sorted(package.rglob("*.py")))
    return [name, *(".".join((name, *m.parts)).removesuffix(".__init__") for m in modules
                    if m.name not in ("__init__", "__main__") or len(m.parts) > 1 and m.name == "__init__")]


# NOTE: these import torch only inside a function the frontend may reach once (converting the default model on a
# first `kvbaton serve`, `kvbaton generate`), so import-linter, which sees function-level imports, cannot name them;
# their module-level imports are checked here all the same (the HTTP process imports them at start).
LAZILY_TORCH = ["kvbaton.cli", "kvbaton.server.launch"]
TORCH_FREE = [*_contract_modules(), *LAZILY_TORCH]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module: str) -> None:
    """Each name of the contract, and for a package every module in it, imports with torch unimportable."""
    imports = "".join(f"import {name}\n" for name in _with_submodules(module))
    code = ("import sys\nsys.modules['torch'] = None\n" + imports +
            "loaded = {name.split('.')[0] for name, mod in sys.modules.items() if mod is not None}\n"
            "assert 'torch' not in loaded, sorted(loaded)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_frontends_tokenizer_loads_without_torch(default_model_dir) -> None:
    """`kvbaton serve`'s HTTP process loads the checkpoint's tokenizer (chat template included) with torch
    unimportable: transformers' AutoTokenizer imports torch, so the tokenizers-backed class is built directly."""
    code = ("import sys\nsys.modules['torch'] = None\nfrom kvbaton.text.tokenizer import Tokenizer\n"
            f"tok = Tokenizer({str(default_model_dir)!r})\n"
            "assert tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]).endswith('assistant\\n')\n"
            "assert tok.decode(tok.encode('Hello there')) == 'Hello there' and tok.eos_token_id == 2\n"
            "loaded = {name.split('.')[0] for name, mod in sys.modules.items() if mod is not None}\n"
            "assert 'torch' not in loaded, sorted(loaded)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_serves_parser_imports_no_other_commands_package() -> None:
    """`kvbaton serve` (on every worker replacement's start path) builds only its own parser: the planner's,
    simulator's, doctor's and bench client's packages (numpy among them, ~0.3 s) stay unimported."""
    code = ("import sys\nfrom kvbaton.cli import build_parser\n"
            "build_parser('serve').parse_args(['serve', '--prefill', '1', '--decode', '1'])\n"
            "loaded = sorted(n for n in sys.modules if n.startswith(('kvbaton.plan', 'kvbaton.sim', 'kvbaton.doctor',"
            " 'kvbaton.bench', 'numpy')))\nassert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
