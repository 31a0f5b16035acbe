"""Temporary run folders of the external cost models (simulators/external.py): a run killed before its cleanup
leaves its folder, which the next run of that kind removes once the folder's process is gone."""

import subprocess
import sys
import tempfile

from simulators.external import OWNER, run_folder


def test_a_run_removes_the_folders_of_dead_runs_and_keeps_live_and_unowned_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = ("dse-sim-dead", "dse-sim-live", "dse-sim-x", "dse-emu-y")
    dead, live, unowned, other = (tmp_path / name for name in names)
    for folder in (dead, live, unowned, other):
        folder.mkdir()
        (folder / "trace.0.et").write_bytes(b"\0" * 1024)
    (dead / OWNER).write_text(gone.stdout.strip())  # a process that has exited
    (live / OWNER).write_text("1")  # init: alive
    (other / OWNER).write_text(gone.stdout.strip())  # dead, but of another kind
    made = run_folder(None, "point", "sim")
    assert not dead.exists() and live.exists() and unowned.exists() and other.exists()
    assert made.parent == tmp_path and made.name.startswith("dse-sim-") and (made / OWNER).read_text().isdigit()
