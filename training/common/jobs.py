"""Recipe processes started by the reproduction scripts: each logged to its own file and timed, and all of them
stopped together on SIGTERM / Ctrl-C (each recipe writes a checkpoint and exits; rerunning resumes them)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

RUNNING: set = set()  # recipe processes in flight
STOPPING: list = []  # set once a stop signal arrived: no new run starts


def stop_running(signum, frame):
    """Signal handler: pass the stop on to the recipe processes, wait for them, and exit."""
    STOPPING.append(signum)
    for process in list(RUNNING):
        process.send_signal(signal.SIGTERM)
    for process in list(RUNNING):
        process.wait()
    raise SystemExit(128 + signum)


def run_logged(command: list, log_path: str, label: str, threads: str) -> tuple[int | None, float]:
    """Run ``command`` with its output appended to ``log_path`` and ``OMP_NUM_THREADS=threads``; returns its exit
    status and the elapsed seconds, or ``(None, 0.0)`` without starting it once a stop arrived."""
    if STOPPING:
        return None, 0.0
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] start {label}  (log: {log_path})", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TQDM_MININTERVAL": "30"}
    if __package__.split(".")[0] != "hf_spectral":
        # A checkout's `training` package: its recipes import from the checkout's root, wherever the child starts
        # (the installed `hf_spectral.recipes` imports from anywhere).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), root]))
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        RUNNING.add(process)
        code = process.wait()
        RUNNING.discard(process)
    elapsed = time.time() - started
    print(f"[{time.strftime('%H:%M:%S')}] done  {label}: exit {code}, {elapsed / 60:.1f} min", flush=True)
    return code, elapsed
