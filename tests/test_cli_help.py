"""Every ``meshscope <command> --help`` as a user runs it: exit 0 and a description that is whole sentences
(a description cut from a docstring's first line stopped mid-sentence: "every run", "[--port P] [--host
127.0.0.1]``:")."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from meshscope.cli import COMMANDS

def description(help_text: str) -> str:
    """argparse's description: the paragraph after the usage block, up to the options (one line)."""
    paragraphs = re.split(r"\n\s*\n", help_text.strip())
    assert paragraphs[0].startswith("usage:"), help_text[:300]
    assert len(paragraphs) > 2 and not paragraphs[1].lstrip().startswith(("options:", "positional")), help_text[:600]
    return " ".join(paragraphs[1].split())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_describes_the_command_in_whole_sentences(command):
    out = subprocess.run([sys.executable, "-m", "meshscope.cli", command, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = description(out.stdout)
    assert text.endswith((".", ".)")), f"meshscope {command} --help: the description ends mid-sentence: {text!r}"
    assert text[0].isupper() or text.startswith("``"), text
    assert text.count("``") % 2 == 0 and text.count("(") == text.count(")"), text
