"""The `kvfleet` command line: one module per subcommand, imported only when that command runs."""

from __future__ import annotations

import subprocess
import sys


def test_pull_does_not_import_torch():
    # the init container runs `kvfleet pull` before anything else: keep it light
    code = ("import sys\nfrom kvfleet_runtime.cli import main\n"
            "try:\n    main(['pull', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert "kvfleet pull" in out.stdout


def test_the_engine_flags_are_read_without_torch():
    # `kvfleet bench serve` is a client (it may run where torch is not installed), and every
    # --help answers at once: reading the engine's flags imports no torch
    for argv in (["bench", "serve", "--help"], ["serve", "--help"], ["bench", "throughput", "--help"]):
        code = ("import sys\nfrom kvfleet_runtime.cli import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                "print('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip().splitlines()[-1] == "False", argv
        assert "--num-prompts" in out.stdout or "--max-num-seqs" in out.stdout, argv


def test_top_level_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for command in ("serve", "generate", "pull", "bench", "make-model"):
        assert command in out
