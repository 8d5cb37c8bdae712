"""Output on terminals and in logs (docs/design/fastvideo-integration.md, "Output on terminals and in logs"): run as a
user runs them with stdout on a pipe and stderr in a file (`cmd 2> log | tee`, a CI log), the package's commands write
plain lines: no ANSI escape sequence (no ESC byte) and no carriage-return progress updates. On a real terminal (a
pseudo-terminal) the decoder's progress bar is still drawn and FastVideo's colours are kept, except with NO_COLOR set.
`fastvideo generate`, the demo and `fastvideo serve` are checked on their own runs' output in test_e2e_generate.py
and test_serve.py."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from _pan2_helpers import OFFLINE, REPO

ESC, CR = b"\x1b", b"\r"


def run_on(argv: list[str], folder: Path, terminal: tuple[str, ...] = (), env: dict | None = None,
           timeout_s: float = 300) -> tuple[int, bytes, bytes, bytes]:
    """Run `argv` with each stream named in `terminal` ("stdout", "stderr") on an 80x24 pseudo-terminal, stdout
    otherwise on a pipe and stderr in a file. -> (exit code, what the terminal got, the pipe's bytes, the file's)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    log = folder / "stderr.log"
    with open(log, "wb") as stderr_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=REPO,
                                stdout=slave if "stdout" in terminal else subprocess.PIPE,
                                stderr=slave if "stderr" in terminal else stderr_file,
                                env={**os.environ, **OFFLINE, **(env or {})})
    os.close(slave)
    piped = {}
    reader = threading.Thread(target=lambda: piped.setdefault("out", proc.stdout.read() if proc.stdout else b""))
    reader.start()
    shown, deadline = bytearray(), time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: no process holds the terminal any more
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None and not terminal:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        reader.join(timeout=30)
    return code, bytes(shown), piped.get("out", b""), log.read_bytes()


# ------------------------------------------------------------------------------------------- the decode command


@pytest.fixture(scope="module")
def decode_argv(wan22_vae, tmp_path_factory) -> list[str]:
    """The decode command on a saved VAE folder and de-normalized latents: 9 passes of 8 x 12 latent rows x columns,
    a second or so on 2 idle CPU cores (the bar draws a line per pass at most every 0.1 s); the output path follows."""
    folder = tmp_path_factory.mktemp("plain")
    wan22_vae.save_pretrained(folder / "vae")
    torch.save(torch.randn(1, wan22_vae.config.z_dim, 9, 8, 12, generator=torch.Generator().manual_seed(0)),
               folder / "z.pt")
    return [sys.executable, "-m", "fastvideo_pan2_ext.decode", str(folder / "z.pt"), "--vae", str(folder / "vae"),
            "--denormalized", "--backend", "torch", "--device", "cpu", "--frames-per-pass", "1", "-y", "-o"]


# tqdm's own variables, which the decoder's bar honours: drawn at once (not 3 s late) and redrawn at every pass (not
# at most every 0.1 s), wherever it is drawn at all.
SHOW_AT_ONCE = {"TQDM_DELAY": "0", "TQDM_MININTERVAL": "0"}


@pytest.mark.slow
def test_the_decode_command_writes_plain_lines_to_a_pipe_and_a_file(decode_argv, tmp_path):
    video = tmp_path / "v.mp4"
    code, _, out, err = run_on([*decode_argv, str(video)], tmp_path, env=SHOW_AT_ONCE)
    assert code == 0, err[-3000:]
    assert out == f"wrote 33 frames to {video}\n".encode()
    assert ESC not in out + err and CR not in out + err, err[-3000:]


@pytest.mark.slow
def test_the_decode_command_draws_its_bar_on_a_terminal(decode_argv, tmp_path):
    video = tmp_path / "v.mp4"
    code, shown, out, err = run_on([*decode_argv, str(video)], tmp_path, terminal=("stderr",), env=SHOW_AT_ONCE)
    assert code == 0, shown[-3000:]
    assert CR + b"VAE decode:   0%" in shown and CR + b"VAE decode: 100%" in shown, shown[-3000:]  # redrawn in place
    assert out == f"wrote 33 frames to {video}\n".encode() and err == b""


@pytest.mark.slow
def test_the_tiny_checkpoint_maker_prints_its_folder_only(tmp_path):
    """README's first command: its folder on stdout, nothing on stderr (no bar of transformers' save)."""
    folder = tmp_path / "wan21-tiny"
    code, _, out, err = run_on([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(folder),
                                "--layout", "wan2.1-t2v"], tmp_path)
    assert code == 0 and out == f"{folder}\n".encode(), err[-3000:]
    assert ESC not in err and CR not in err, err[-3000:]


# ---------------------------------------------------------------------------------------- FastVideo's colours

# What a FastVideo worker does with its output (`WorkerMultiprocProc`: `decorate_logs`, then FastVideo's logger;
# with WORLD_SIZE > 1 its first info line comes with a coloured warning), one line on each stream.
WORKER_OUTPUT = textwrap.dedent("""
    import os, sys
    os.environ["WORLD_SIZE"] = "2"
    import fastvideo
    from fastvideo.logger import init_logger
    from fastvideo.utils import decorate_logs

    decorate_logs("Worker")
    init_logger("fastvideo.worker").info("a line of the log")
    print("a line on stdout", flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
""")


@pytest.mark.slow
def test_fastvideos_colours_go_to_a_terminal_only(tmp_path):
    code, shown, out, err = run_on([sys.executable, "-c", WORKER_OUTPUT], tmp_path, terminal=("stderr",))
    assert code == 0, (shown + out + err)[-3000:]
    # stdout on a pipe: the log line, FastVideo's warning and the printed line, each prefixed, all plain.
    assert ESC not in out, out[-3000:]
    for line in (b"a line of the log", b"will only log from the local main process", b"a line on stdout"):
        assert line in out, out[-3000:]
    assert out.count(b"(Worker pid=") == 3, out[-3000:]
    # stderr on the terminal: FastVideo's colours, as before.
    assert b"\x1b[1;36m(Worker pid=" in shown and b"a line on stderr" in shown, shown[-3000:]


def test_colours_follow_no_color_on_a_terminal_too(monkeypatch, tmp_path):
    """The rule the test above runs (`compat.logs.colours`), on a real terminal and a real file."""
    from fastvideo_pan2_ext.fastvideo_integration import compat

    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal, open(tmp_path / "log", "w") as log:
        monkeypatch.delenv("NO_COLOR", raising=False)
        assert compat.logs.colours(terminal) and not compat.logs.colours(log)
        monkeypatch.setenv("NO_COLOR", "1")
        assert not compat.logs.colours(terminal) and not compat.logs.colours(log)
        monkeypatch.setenv("NO_COLOR", "")  # no-color.org: an empty NO_COLOR does not count
        assert compat.logs.colours(terminal)
    os.close(master)
