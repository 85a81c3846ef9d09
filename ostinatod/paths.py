"""Where Ostinato keeps its files (platformdirs), with one override for tests and portable installs.

Layout (docs/design.md, "Data and paths"):
  config  -> settings.toml
  data    -> models index, hardware profile, traces, residency sets, demo model, native build cache
  state   -> logs
  runtime -> pid file, control socket (mode 0600)

``OSTINATO_HOME=/some/dir`` puts all four under that directory (config/, data/, state/, run/).
What every user of one installation shares (the demo model's tokenizer vocabulary) lives beside
the installed package instead: :func:`install_data_dir`.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP = "ostinato"


@dataclass(frozen=True)
class Paths:
    """The four Ostinato directories. Created on demand by :meth:`ensure`."""

    config: Path
    data: Path
    state: Path
    runtime: Path

    @property
    def settings_file(self) -> Path:
        return self.config / "settings.toml"

    @property
    def log_file(self) -> Path:
        return self.state / "ostinatod.log"

    @property
    def pid_file(self) -> Path:
        return self.runtime / "ostinatod.pid"

    @property
    def control_socket(self) -> Path:
        return self.runtime / "control.sock"

    @property
    def models_dir(self) -> Path:
        return self.data / "models"

    @property
    def traces_dir(self) -> Path:
        return self.data / "traces"

    @property
    def residency_dir(self) -> Path:
        return self.data / "residency"

    @property
    def hardware_profile(self) -> Path:
        return self.data / "hardware.json"

    @property
    def native_dir(self) -> Path:
        return self.data / "native"

    def residency_file(self, fingerprint: str, workload: str) -> Path:
        """The planned residency set of one model and workload:
        ``<data>/residency/<fingerprint>/<workload>.json`` (the one place this rule is written)."""
        return residency_file(fingerprint, workload, self.data)

    def trace_file(self, fingerprint: str, workload: str) -> Path:
        """The routing trace of one model and workload: ``<data>/traces/<fingerprint>/<workload>.json``."""
        return trace_file(fingerprint, workload, self.data)

    def ensure(self) -> "Paths":
        for p in (self.config, self.data, self.state):
            p.mkdir(parents=True, exist_ok=True)
        self.runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self


def home_paths(home: Path) -> Paths:
    """The directories under one ``OSTINATO_HOME`` (the daemon's layout there; the bench reads the
    files of the daemons it starts through it)."""
    h = Path(home).expanduser().resolve()
    return Paths(h / "config", h / "data", h / "state", h / "run")


def get_paths() -> Paths:
    """Resolve the directories from ``OSTINATO_HOME`` or platformdirs (user scope)."""
    home = os.environ.get("OSTINATO_HOME")
    if home:
        return home_paths(Path(home))
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        runtime = platformdirs.user_runtime_dir(APP)
    # user_runtime_dir may not exist without a login session (e.g. CI as root): fall back to state.
    if not os.access(Path(runtime).parent, os.W_OK):
        runtime = os.path.join(platformdirs.user_state_dir(APP), "run")
    return Paths(
        Path(platformdirs.user_config_dir(APP)),
        Path(platformdirs.user_data_dir(APP)),
        Path(platformdirs.user_state_dir(APP)),
        Path(runtime),
    )


def residency_file(fingerprint: str, workload: str, data_dir: Path | None = None) -> Path:
    """``<data>/residency/<fingerprint>/<workload>.json``: where the planner writes a workload's
    residency set and the engine, the control API and the re-planner look for it. ``data_dir``
    defaults to :func:`get_paths`'s data dir."""
    base = Path(data_dir) if data_dir else get_paths().data
    return base / "residency" / str(fingerprint) / f"{workload}.json"


def trace_file(fingerprint: str, workload: str, data_dir: Path | None = None) -> Path:
    """``<data>/traces/<fingerprint>/<workload>.json`` (the workload name is not checked here)."""
    base = Path(data_dir) if data_dir else get_paths().data
    return base / "traces" / str(fingerprint) / f"{workload}.json"


def install_data_dir() -> Path:
    """``<sys.prefix>/share/ostinato``: files ``ostinato build`` keeps with the installed package
    (the virtual environment install.sh made), so that a daemon started by another user or with
    another HOME / ``OSTINATO_HOME`` finds them. Not created here; may be read-only."""
    return Path(sys.prefix) / "share" / APP
