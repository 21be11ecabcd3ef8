"""Run a real `tritonserver` from the `nvidia-pytriton` wheel (tests, the example, `k3trt
triton-serve`). Production deployments may run NVIDIA's Triton container instead; the same
repository works there (README: Serving with Triton).

What it takes to run k3trt in that server's Python backend, found by trying (Triton 2.51 in
nvidia-pytriton 0.7.0):
- the wheel ships the server, its libraries and one backend stub per Python (3.8-3.13); the stub
  for this interpreter goes next to the backend (`backends/python/triton_python_backend_stub`),
  as pytriton does. The stub links libpython3.X.so: the library directory of this interpreter
  goes first on LD_LIBRARY_PATH, or the system's libpython of the same minor version is loaded.
- the stub's embedded interpreter takes its prefix from the first `python3` on PATH and ignores
  PYTHONPATH; the Python backend's EXECUTION_ENV_PATH (a directory with bin/activate) puts that
  environment's bin first on PATH. So the repository names an environment (`execution_env`).
- the stub is built against numpy 1.x: under numpy 2 every BYTES input arrives corrupted (its
  length prefix read as its first byte repeated) and the stub aborts. `stub_env` is therefore a
  venv holding numpy<2 that sees this interpreter's site-packages (torch, k3trt, ...) through a
  .pth file, after its own numpy.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

PYTRITON = "nvidia-pytriton==0.7.0"
PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3trt" / "triton"


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip install {' '.join(args)} failed: {' / '.join(tail)}")


def pytriton_site(cache: Path | None = None, install: bool = True) -> Path:
    """The site dir holding pytriton/tritonserver: importable here, else in `cache`, else installed
    there with pip (--no-deps: its numpy<2 pin concerns only its own wrapper)."""
    spec = importlib.util.find_spec("pytriton")
    found = [Path(spec.origin).parents[1]] if spec and spec.origin else []
    site = (cache or default_cache()) / "pytriton"
    for d in [*found, site]:
        if (d / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
            return d
    if not install:
        raise FileNotFoundError(f"no tritonserver: pip install --no-deps {PYTRITON}")
    log.info("installing %s into %s", PYTRITON, site)
    _pip("--no-deps", "--target", str(site), PYTRITON)
    return site


def server_dir(site: Path, cache: Path | None = None) -> Path:
    """A copy of the wheel's server whose Python backend has the stub of this interpreter."""
    dist = site / "pytriton" / "tritonserver"
    out = (cache or default_cache()) / f"server-py{PY}"
    stub = out / "backends" / "python" / "triton_python_backend_stub"
    if not stub.is_file():
        src = dist / "python_backend_stubs" / PY / "triton_python_backend_stub"
        if not src.is_file():
            raise FileNotFoundError(f"{PYTRITON} has no Python backend stub for Python {PY}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(dist, out, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy(src, stub.with_suffix(".tmp"))
        stub.with_suffix(".tmp").rename(stub)          # last: its presence marks the copy complete
    return out


def stub_env(cache: Path | None = None) -> Path:
    """A venv for the backend stub (module doc): numpy<2, then this interpreter's packages."""
    env = (cache or default_cache()) / f"stub-env-py{PY}"
    ready = env / ".k3trt-ready"
    sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    if ready.is_file() and ready.read_text() == repr(sites):
        return env
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    own = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    _pip("--no-deps", "--target", str(own), "numpy<2")
    (own / "k3trt_stub_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in sites))
    ready.write_text(repr(sites))
    return env


def _die_with_parent() -> None:
    """In the child (Linux): SIGTERM when the process that started it dies, however it dies, so a
    killed test run leaves no server behind."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """`tritonserver` with `repo`: `with TritonServer(repo, site) as s: s.http`. Loopback and free
    ports unless `host` / `ports` ({"http", "grpc", "metrics"} -> port) say otherwise; `log_path`
    None: its log goes to this process's stdout."""

    def __init__(self, repo: str | Path, site: Path, *, log_path: str | Path | None, cache: Path | None = None,
                 host: str = "127.0.0.1", ports: dict[str, int] | None = None):
        self.repo, self.log_path = Path(repo).resolve(), None if log_path is None else Path(log_path)
        self.root = server_dir(site, cache)
        self.libs = site / "nvidia_pytriton.libs"
        self.host = host
        self.ports = ports or {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        self.proc: subprocess.Popen | None = None

    local = property(lambda self: "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host)
    http = property(lambda self: f"{self.local}:{self.ports['http']}")
    grpc = property(lambda self: f"{self.local}:{self.ports['grpc']}")
    metrics_url = property(lambda self: f"http://{self.local}:{self.ports['metrics']}/metrics")

    def start(self, timeout: float = 120.0) -> "TritonServer":
        libdir = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
            p for p in (libdir, str(self.libs), os.environ.get("LD_LIBRARY_PATH")) if p)}
        cmd = [str(self.root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
               f"--backend-directory={self.root / 'backends'}", f"--cache-directory={self.root / 'caches'}",
               f"--http-port={self.ports['http']}", f"--grpc-port={self.ports['grpc']}",
               f"--metrics-port={self.ports['metrics']}", f"--http-address={self.host}",
               f"--grpc-address={self.host}", f"--metrics-address={self.host}", "--exit-timeout-secs=15",
               "--log-info=true"]
        with open(self.log_path or os.devnull, "wb") as out:     # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=None if self.log_path is None else out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"tritonserver did not become ready (exit {self.proc.returncode}):\n{tail}")
            time.sleep(0.25)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait(self) -> int:
        """Until the server exits (Ctrl-C: stopped); its exit status."""
        try:
            return self.proc.wait()
        except KeyboardInterrupt:
            log.info("stopping tritonserver")
            self.stop()
            return 0

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to its process group (the stubs) if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver did not exit in %.0fs; killing its process group", timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)        # its own session: only its stubs
        self.proc.wait(10)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
