"""The processes that never run the model load no torch: the HTTP frontend, the router, the
deployment code, the scheduler and the content address import with torch made unimportable.
(Import-linter, run by the test command, keeps the layers in order; this checks the one thing it
cannot: that no third-party package in the chain pulls torch in.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "kvbaton.server.api",
    "kvbaton.server.launch",
    "kvbaton.server.engine_client",
    "kvbaton.disagg.router",
    "kvbaton.disagg.worker_pool",
    "kvbaton.cluster.deploy",
    "kvbaton.cluster.local",
    "kvbaton.engine.scheduler",
    "kvbaton.engine.info",
    "kvbaton.engine.transfers",
    "kvbaton.kv.hashing",
    "kvbaton.kv.connectors.base",
    "kvbaton.cli",
    "kvbaton.server.tools",
    "kvbaton.server.tool_calling",
    "kvbaton.server.grammars",
    "kvbaton.engine.structured.grammar",
    "kvbaton.client.cli",
    "kvbaton.sim.simulator",
    "kvbaton.sim.run",
    "kvbaton.sim.profiled",
    "kvbaton.sim.roofline",
    "kvbaton.plan.cli",
    "kvbaton.doctor.cli",
    "kvbaton.cluster.autoscale",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module: str) -> None:
    code = (f"import sys\nsys.modules['torch'] = None\nimport {module}\n"
            "loaded = {name.split('.')[0] for name, mod in sys.modules.items() if mod is not None}\n"
            "assert 'torch' not in loaded, sorted(loaded)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_frontends_tokenizer_loads_without_torch(default_model_dir) -> None:
    """`kvbaton serve`'s HTTP process loads the checkpoint's tokenizer (chat template included) with torch
    unimportable: transformers' AutoTokenizer imports torch, so the tokenizers-backed class is built directly."""
    code = ("import sys\nsys.modules['torch'] = None\nfrom kvbaton.engine.tokenizer import Tokenizer\n"
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
